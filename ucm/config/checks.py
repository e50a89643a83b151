"""The configuration's error and its small checkers: each names the key path in its message."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ucm.store.config import near_miss

logger = logging.getLogger(__name__)


class UCMConfigError(ValueError):
    """A configuration problem; the message names the offending key path or file."""


# -- small checkers: each names `path` in its error ----------------------------------------------


def _type_name(value: Any) -> str:
    return type(value).__name__


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise UCMConfigError(f"{path} must be a mapping, got {_type_name(value)}")
    return value


def _require(d: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise UCMConfigError(f"{path}.{key} is required" if path else f"{key} is required")
    return d[key]


def _warn_unknown(d: Mapping[str, Any], known: set[str] | frozenset[str], path: str,
                  no_effect: frozenset[str] = frozenset()) -> None:
    """Unknown keys are warned about; one a typo away from a known key is an error naming it;
    keys in `no_effect` (UCM's, meaningless here) get a note."""
    unknown = sorted(str(k) for k in d if k not in known)
    for key in unknown:
        near = near_miss(key, known)
        if near is not None:
            raise UCMConfigError(f"{path}: unknown key {key!r}; did you mean {near!r}?")
    for key in [k for k in unknown if k in no_effect]:
        logger.info("%s: %r has no effect here (UCM option, accepted for compatibility)", path, key)
    unknown = [k for k in unknown if k not in no_effect]
    if unknown:
        logger.warning("%s: unknown keys ignored: %s", path, ", ".join(unknown))


def _key(path: str, key: str) -> str:
    """`a.b["model.layers.1..."]`: dotted names stay readable inside a dotted path."""
    return f"{path}[{json.dumps(key)}]"


def attn_layer_name(index: int) -> str:
    """vLLM's name of decoder layer `index`'s attention, as used in `compute_meta`."""
    return f"model.layers.{index}.self_attn.attn"

