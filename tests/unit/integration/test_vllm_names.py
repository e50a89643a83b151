"""The probe of vLLM's unstable names (vllm_names.py): the installed vLLM has every name, a missing
one refuses what needs it at start-up with its name and reason (Blend alone when only Blend's are
missing: a prefix-only config still starts), and the list is held to what the adapter uses."""

from __future__ import annotations

import ast
import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.integration.test_connector_errors import build_and_close, connector, extra_config, vllm_config
from ucm.integration.vllm import vllm_names
from ucm.integration.vllm.vllm_names import (CONNECTOR_HOOKS, NAMES, Check, Need, VllmName, VllmNamesMissing,
                                             missing, needs_for, refusal, require)

ROOT = Path(__file__).resolve().parents[3] / "ucm"
ADAPTER = ROOT / "integration" / "vllm"
# Private names the adapter reads that are no vLLM attribute of their own.
NOT_VLLM = {"_C": "torch's namespace of vLLM's compiled ops; kv_layout/cpu.py falls back to tensor indexing "
                  "without cpu_attn_reshape_and_cache"}


@pytest.fixture(scope="module", autouse=True)
def _cpu_kv_cache_space():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


# ---- the installed vLLM ------------------------------------------------------------------------


def test_installed_vllm_has_every_name():
    assert [str(m) for m in missing(set(Need))] == []


def test_each_process_probes_what_it_uses():
    assert needs_for(blend=False, worker=True) == {Need.CONNECTOR}
    assert needs_for(blend=False, worker=True, lora=True, tensor_parallel=True) == {Need.CONNECTOR, Need.TP}
    assert needs_for(blend=True, worker=False, lora=True) == {Need.CONNECTOR, Need.BLEND_PLAN}
    assert needs_for(blend=True, worker=True, lora=True) == {Need.CONNECTOR, Need.BLEND_PLAN, Need.BLEND_FORWARD,
                                                             Need.LORA}


# ---- start-up refusals on a real VllmConfig --------------------------------------------------------


def test_missing_blend_forward_name_refuses_blend_not_prefix_offload(model_dir, tmp_path, monkeypatch):
    import vllm.forward_context

    # Every module a worker imports is imported first, with the name present: what is tested is
    # the probe's refusal, not an import failing (which a test run alone would hit otherwise).
    build_and_close(vllm_config(model_dir, extra_config(tmp_path / "warm")), "WORKER")
    monkeypatch.delattr(vllm.forward_context, "get_forward_context")
    with pytest.raises(VllmNamesMissing) as err:
        connector(vllm_config(model_dir, extra_config(tmp_path / "store")), "WORKER")
    message = str(err.value)
    assert "vllm.forward_context:get_forward_context" in message
    assert "the step's attention metadata" in message  # its reason
    assert "Blend is refused" in message and "prefix offload" in message
    assert [m.entry.need for m in err.value.missing] == [Need.BLEND_FORWARD]
    build_and_close(vllm_config(model_dir, extra_config(tmp_path / "store")), "SCHEDULER")  # not its name
    prefix_only = vllm_config(model_dir, extra_config(tmp_path / "store", blend=False))
    for role in ("SCHEDULER", "WORKER"):
        build_and_close(prefix_only, role)


def test_missing_connector_name_refuses_the_connector(model_dir, tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    monkeypatch.delattr(KVConnectorBase_V1, "_get_connector_metadata")
    config = vllm_config(model_dir, extra_config(tmp_path / "store", blend=False))
    for role in ("SCHEDULER", "WORKER"):
        with pytest.raises(VllmNamesMissing, match=r"KVConnectorBase_V1\._get_connector_metadata: not found") as err:
            connector(config, role)
        assert "The UCM connector is refused" in str(err.value)


def test_missing_scheduler_internal_refuses_blend_first_scheduler(monkeypatch, caplog):
    from vllm.v1.core.sched.request_queue import RequestQueue

    from ucm.integration.vllm.connector import blend_first_scheduler as bfs

    monkeypatch.delattr(RequestQueue, "prepend_request")
    with pytest.raises(VllmNamesMissing, match=r"RequestQueue\.prepend_request: not found.*BlendFirstScheduler"):
        bfs.BlendFirstScheduler()
    blend = {"kv_connector": "UCMConnector", "kv_connector_extra_config": {"ucm_sparse_config": {"Blend": {}}}}
    with caplog.at_level(logging.WARNING, logger="ucm"):
        assert bfs.default_scheduler_cls(blend, None, False) is None  # vLLM's own scheduler, with a warning
    assert "prepend_request" in caplog.text


def test_blend_alone_is_refused_when_only_its_names_are_missing(monkeypatch):
    lora = VllmName("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU", ("_renamed_indices",), Need.LORA,
                    "rows' adapters")
    monkeypatch.setattr(vllm_names, "NAMES", (*NAMES, lora))
    with pytest.raises(VllmNamesMissing) as err:
        require(needs_for(blend=True, worker=True, lora=True), ["LlamaForCausalLM"])
    assert "PunicaWrapperCPU._renamed_indices: not found [Blend with LoRA adapters: rows' adapters]" in str(err.value)
    assert "connector's own names are present" in str(err.value)
    require(needs_for(blend=True, worker=True, lora=False), ["LlamaForCausalLM"])


# ---- how names are probed (a fake vLLM module) --------------------------------------------------------

FAKE = '''
class Base:
    def __init__(self):
        self.inherited = 1


class Impl(Base):
    scale = 1.0

    def __init__(self, window):
        super().__init__()
        self.window = window
        self.first, self.second = 1, 2
        self.register_buffer("table", None)

    def register_buffer(self, name, value):
        pass


def kernel(num_reqs, isa, *, causal=True):
    return num_reqs


def reordered(key, query):
    return query
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / "fakevllm_probe.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakevllm_probe"
    sys.modules.pop("fakevllm_probe", None)


def probe(owner, names, check=Check.ATTRS, archs=(), architectures=None):
    return [str(m) for m in missing({Need.CONNECTOR}, architectures,
                                    [VllmName(owner, names, Need.CONNECTOR, "a reason", check, archs)])]


def test_class_and_instance_attributes_are_found(fake):
    assert probe(f"{fake}:Impl", ("scale", "window", "first", "second", "table", "inherited")) == []
    assert probe(f"{fake}:Impl", ("scale", "gone")) == [f"{fake}:Impl.gone: not found [{Need.CONNECTOR.value}: "
                                                        "a reason]"]


def test_a_moved_owner_misses_all_its_names(fake):
    (lost,) = probe(f"{fake}:Moved", ("a", "b"))
    assert lost.startswith(f"{fake}:Moved: not found (AttributeError")
    (lost,) = probe("fakevllm_nowhere:Impl", ("a",))
    assert "ModuleNotFoundError" in lost


def test_parameters_we_pass_by_name_and_by_position(fake):
    assert probe(f"{fake}:kernel", ("num_reqs", "causal"), Check.KEYWORDS) == []
    assert probe(f"{fake}:kernel", ("causal", "window"), Check.KEYWORDS) == [
        f"{fake}:kernel(window=...): no such parameter [{Need.CONNECTOR.value}: a reason]"]
    assert probe(f"{fake}:reordered", ("key", "query"), Check.POSITIONAL) == []
    (moved,) = probe(f"{fake}:reordered", ("query", "key"), Check.POSITIONAL)
    assert "parameters reordered: ['key', 'query']" in moved


def test_behaviour_read_from_the_source(fake):
    assert probe(f"{fake}:Impl.__init__", ("self.window",), Check.SOURCE) == []
    assert probe(f"{fake}:Impl.__init__", ("self.isa",), Check.SOURCE) == [
        f"{fake}:Impl.__init__ (source mentions 'self.isa'): no longer in its source [{Need.CONNECTOR.value}: "
        "a reason]"]


def test_model_internals_only_for_the_engine_architecture(fake):
    assert probe(f"{fake}:Impl", ("gone",), archs=("Qwen2ForCausalLM",), architectures=["LlamaForCausalLM"]) == []
    assert len(probe(f"{fake}:Impl", ("gone",), archs=("Qwen2ForCausalLM",), architectures=["Qwen2ForCausalLM"])) == 1
    assert len(probe(f"{fake}:Impl", ("gone",), archs=("Qwen2ForCausalLM",))) == 1  # unknown: every family


def test_refusal_says_what_still_runs():
    entry = VllmName("vllm.config", ("gone",), Need.BLEND_PLAN, "why")
    lacking = missing({Need.BLEND_PLAN}, None, [entry])
    assert "Blend is refused" in refusal(lacking, {Need.CONNECTOR, Need.BLEND_PLAN})
    entry = VllmName("vllm.config", ("gone",), Need.TP, "why")
    assert "The UCM connector is refused" in refusal(missing({Need.TP}, None, [entry]), {Need.CONNECTOR, Need.TP})


# ---- the list matches the adapter ---------------------------------------------------------------------


def _defined_in_ucm() -> set[str]:
    """Names ucm itself defines (functions, classes, module globals, attributes set on self/cls)."""
    names = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def _private_names_read(path: Path) -> set[str]:
    """`_name`s the file reads: attributes, names imported from vllm, getattr/hasattr strings."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names.update(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_every_private_vllm_name_the_adapter_reads_is_probed():
    listed = {n for e in NAMES for n in e.names} | {p for e in NAMES for p in re.split(r"[.:]", e.owner)}
    ours = _defined_in_ucm()
    unlisted = sorted(f"{name} ({path.relative_to(ROOT.parent)})" for path in ADAPTER.rglob("*.py")
                      for name in _private_names_read(path) - ours - listed - set(NOT_VLLM))
    assert not unlisted, "list these in ucm/integration/vllm/vllm_names.py:\n" + "\n".join(unlisted)


def test_every_hook_the_connector_overrides_is_probed():
    from ucm.integration.vllm.connector.ucm_connector import UCMConnector

    ours = {"take_blend_step", "blend_forward_failed", "scheduler_side"}  # the Blend model's and tests' own
    overridden = {n for n in vars(UCMConnector) if not n.startswith("_")} - ours
    assert overridden == set(CONNECTOR_HOOKS)


def test_every_scheduler_method_blend_first_overrides_is_probed():
    from ucm.integration.vllm.connector.blend_first_scheduler import BlendFirstScheduler

    (scheduler,) = [e for e in NAMES if e.owner.endswith(":Scheduler")]
    assert {n for n in vars(BlendFirstScheduler) if not n.startswith("_")} <= set(scheduler.names)
