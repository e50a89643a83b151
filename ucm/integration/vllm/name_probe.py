"""Probing one of vLLM's names: does the owner (a module, a class, a function) still have it,
as an attribute, a parameter or in its source. The list of names is vllm_names.py."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass


class Need(enum.Enum):
    """What relies on a name; each process probes the needs it will use (`needs_for`)."""

    CONNECTOR = "the UCM connector (prefix offload)"
    TP = "the UCM connector under tensor parallelism"
    BLEND_PLAN = "Blend (the scheduler's plan)"
    BLEND_FORWARD = "Blend (the workers' loads and forward)"
    LORA = "Blend with LoRA adapters"
    BLEND_FIRST = "BlendFirstScheduler"


class Check(enum.Enum):
    """How a name is probed on its owner."""

    ATTRS = "attribute"  # on the owner, or an instance attribute its class's source assigns
    POSITIONAL = "positional parameters"  # in the signature, in this order (we pass them by position)
    KEYWORDS = "keyword parameters"  # in the signature (we pass them by name)
    SOURCE = "source text"  # the owner's source says it (behaviour we rely on, not a name of its own)


@dataclass(frozen=True)
class VllmName:
    """Names on one vLLM owner (`"module"` or `"module:Qualified.name"`) and why we need them."""

    owner: str
    names: tuple[str, ...]
    need: Need
    why: str
    check: Check = Check.ATTRS
    archs: tuple[str, ...] = ()  # model internals: probed only for these architectures

    def spelled(self, name: str) -> str:
        if self.check is Check.SOURCE:
            return f"{self.owner} (source mentions {name!r})"
        if self.check is not Check.ATTRS:
            return f"{self.owner}({name}=...)"
        return f"{self.owner}.{name}" if ":" in self.owner else f"{self.owner}:{name}"


@dataclass(frozen=True)
class Missing:
    entry: VllmName
    name: str | None  # None: the owner itself
    detail: str

    def __str__(self) -> str:
        what = self.entry.owner if self.name is None else self.entry.spelled(self.name)
        return f"{what}: {self.detail} [{self.entry.need.value}: {self.entry.why}]"


def probe(entry: VllmName) -> list[Missing]:
    try:
        owner = _resolve(entry.owner)
    except Exception as exc:  # noqa: BLE001 - a moved module or class: every name of it is missing
        return [Missing(entry, None, f"not found ({type(exc).__name__}: {exc})")]
    if entry.check is Check.ATTRS:
        return [Missing(entry, n, "not found") for n in entry.names if not _has(owner, n)]
    if entry.check is Check.SOURCE:
        try:
            source = inspect.getsource(owner)
        except (OSError, TypeError) as exc:
            return [Missing(entry, None, f"source not readable ({exc})")]
        return [Missing(entry, n, "no longer in its source") for n in entry.names if n not in source]
    try:
        params = list(inspect.signature(owner).parameters)
    except (TypeError, ValueError) as exc:
        return [Missing(entry, None, f"no signature ({exc})")]
    lacking = [Missing(entry, n, "no such parameter") for n in entry.names if n not in params]
    if not lacking and entry.check is Check.POSITIONAL:
        order = [params.index(n) for n in entry.names]
        if order != sorted(order):
            lacking.append(Missing(entry, entry.names[0], f"parameters reordered: {params}"))
    return lacking


def _resolve(owner: str):
    module, _, qualname = owner.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _has(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if inspect.ismodule(owner):  # declared, set later (NONE_HASH is set when the engine starts)
        return name in getattr(owner, "__annotations__", {})
    return inspect.isclass(owner) and name in _instance_names(owner)


@functools.cache
def _instance_names(cls: type) -> frozenset[str]:
    """Names instances of `cls` get: dataclass and struct fields, annotations, and the attributes
    the source of its classes from its own package (vLLM's, not torch's) assigns on `self`."""
    names: set[str] = set()
    package = cls.__module__.split(".")[0]
    for klass in cls.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
        names.update(getattr(klass, "__struct_fields__", ()))
        if dataclasses.is_dataclass(klass):
            names.update(f.name for f in dataclasses.fields(klass))
        if klass.__module__.split(".")[0] == package:
            names.update(_assigned_on_self(klass))
    return frozenset(names)


def _assigned_on_self(klass: type) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value)
              and node.func.attr in ("register_buffer", "register_parameter", "register_module")
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"
