"""Typed UCM configuration, parsed once from vLLM's `kv_connector_extra_config`.

Users write the same dict as for UCM::

    {
      "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore",
                          "ucm_connector_config": {"storage_backends": "/mnt/kv"}}],
      "ucm_sparse_config": {"Blend": {"chunk_end_token_id": 2,
                                      "compute_meta": {"model.layers.1.self_attn.attn": {"ratio": 0.2}}}},
    }

Instead of (or besides) writing it inline, the keys can live in a YAML file. Where it is:
  1. `kv_connector_extra_config["UCM_CONFIG_FILE"]`, if set; otherwise
  2. the environment variable `UCM_CONFIG_FILE`, if set and non-empty; otherwise no file.
Keys written in `kv_connector_extra_config` override the file's keys at the TOP LEVEL only:
an inline `ucm_sparse_config` replaces the file's whole `ucm_sparse_config`, it is not merged
into it. (A deep merge would make it impossible to remove a nested key the file sets.)

Everything is checked at start-up, so a typo fails the engine launch with a message naming the
key path (e.g. `ucm_connectors[0].ucm_connector_name`), instead of failing a request later.
Unknown keys are logged as warnings, not errors, so a config written for a newer UCM still loads.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from ucm.config.blend import SPARSE_METHODS, BlendConfig, SparseSpec, parse_sparse
from ucm.config.checks import UCMConfigError, _mapping, _require, _type_name, _warn_unknown, attn_layer_name
from ucm.config.names import (ASYNC_PREFIX_LOADS_KEY, CONFIG_FILE_KEY, EXTRA_NAME, KNOWN_TOP_LEVEL_KEYS,
                               LAYERWISE_KEY, PREFETCH_CHUNKS_KEY,
                              UCM_NO_EFFECT_TOP_LEVEL_KEYS,
                              QUERY_SELECTION, HKVD_SELECTION, ORACLE_SELECTION, BLEND_SELECTIONS,
                              CHUNK_LENGTHS_PARAM, DISABLE_BLEND_PARAM, RATIO_PARAM, SELECTION_PARAM,
                              EXACT_PREFIX_PARAM, CHUNK_STORE_POLICIES, CHUNK_START_TOKENS_PARAM, KV_SHIFT_DEFAULT,
                              MIN_HIT_SHARE_DEFAULT, STEP_CAP_PER_BUDGET, KV_SHIFT_PARAM, KV_SHIFT_SAMPLE_PARAM,
                              KV_SHIFT_SAMPLE_DEFAULT, INDEX_PARAM,
                              REQUEST_PARAMS, BLEND_KEYS, LAYER_META_KEYS)
from ucm.config.stores import StoreSpec

__all__ = [  # the vocabulary (names.py) too: everything importable from ucm.config as before the split
    "ASYNC_PREFIX_LOADS_KEY", "BlendConfig", "SPARSE_METHODS", "SparseSpec", "StoreSpec", "UCMConfig", "UCMConfigError",
    "attn_layer_name",
    "parse_sparse", "CONFIG_FILE_KEY", "EXTRA_NAME", "KNOWN_TOP_LEVEL_KEYS", "UCM_NO_EFFECT_TOP_LEVEL_KEYS",
    "QUERY_SELECTION", "HKVD_SELECTION", "ORACLE_SELECTION", "BLEND_SELECTIONS", "CHUNK_LENGTHS_PARAM",
    "DISABLE_BLEND_PARAM", "RATIO_PARAM", "SELECTION_PARAM", "EXACT_PREFIX_PARAM", "CHUNK_STORE_POLICIES",
    "CHUNK_START_TOKENS_PARAM", "KV_SHIFT_DEFAULT", "MIN_HIT_SHARE_DEFAULT", "STEP_CAP_PER_BUDGET",
    "KV_SHIFT_PARAM", "KV_SHIFT_SAMPLE_PARAM", "KV_SHIFT_SAMPLE_DEFAULT", "INDEX_PARAM", "REQUEST_PARAMS", "BLEND_KEYS", "LAYER_META_KEYS",
]

logger = logging.getLogger(__name__)


def _load_yaml(path: str, source: str) -> dict[str, Any]:
    """Reads the config file; every failure names the file and where its path came from."""
    where = f"{CONFIG_FILE_KEY} file {path!r} (from {source})"
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise UCMConfigError(f"{where} does not exist") from e
    except (OSError, UnicodeDecodeError) as e:
        raise UCMConfigError(f"{where} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise UCMConfigError(f"{where} is not valid YAML: {e}") from e
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else _type_name(data)
        raise UCMConfigError(f"{where} must hold a mapping at top level, got {got}")
    data = dict(data)
    if CONFIG_FILE_KEY in data:
        logger.warning("%s sets %s itself; nested config files are not followed", where, CONFIG_FILE_KEY)
        del data[CONFIG_FILE_KEY]
    return data


@dataclass(frozen=True)
class UCMConfig:
    """The whole parsed configuration.

    `extra` is the merged raw dict (file keys overridden by inline keys, deep-copied), for
    consumers of keys this module does not know. `config_file` is the YAML file read, if any.
    `async_prefix_loads`: whether a request whose stored KV is an exact prefix alone waits for it
    between steps instead of holding the step of every request in the batch while it is read
    (True, False, or "auto": while the store's reads have recently been slow). `prefetch_chunks`:
    the same for a blend request's chunk blocks, read while it waits in the queue.
    """

    stores: tuple[StoreSpec, ...]
    sparse: SparseSpec | None
    extra: dict[str, Any]
    config_file: str | None = None
    async_prefix_loads: bool | str = "auto"
    prefetch_chunks: bool | str = False
    use_layerwise: bool = True  # chunk KV of Blend steps read layer group by layer group (LAYERWISE_KEY)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ
    ) -> UCMConfig:
        inline = dict(_mapping(extra, EXTRA_NAME)) if extra is not None else {}

        config_file: str | None = None
        source = ""
        if CONFIG_FILE_KEY in inline:
            config_file = inline.pop(CONFIG_FILE_KEY)
            if not isinstance(config_file, (str, os.PathLike)):
                raise UCMConfigError(
                    f"{EXTRA_NAME}.{CONFIG_FILE_KEY} must be a path string, got {_type_name(config_file)}"
                )
            config_file = os.fspath(config_file)
            source = f"{EXTRA_NAME}.{CONFIG_FILE_KEY}"
        elif env.get(CONFIG_FILE_KEY):
            config_file = env[CONFIG_FILE_KEY]
            source = f"environment variable {CONFIG_FILE_KEY}"
        merged = _load_yaml(config_file, source) if config_file else {}
        merged.update(inline)  # inline keys win, top level only (see module docstring)
        merged = copy.deepcopy(merged)

        _warn_unknown(merged, KNOWN_TOP_LEVEL_KEYS, EXTRA_NAME, UCM_NO_EFFECT_TOP_LEVEL_KEYS)
        if "ucm_connectors" not in merged and "ucm_connector_name" in merged:
            raise UCMConfigError(
                "ucm_connectors is required: a list of {ucm_connector_name, ucm_connector_config}; "
                "wrap the top-level ucm_connector_name/ucm_connector_config in a one-element list"
            )
        connectors = _require(merged, "ucm_connectors", "")
        if not isinstance(connectors, (list, tuple)):
            raise UCMConfigError(f"ucm_connectors must be a list, got {_type_name(connectors)}")
        if not connectors:
            raise UCMConfigError("ucm_connectors must list at least one store, got an empty list")
        stores = tuple(StoreSpec.from_dict(entry, f"ucm_connectors[{i}]") for i, entry in enumerate(connectors))

        return cls(
            stores=stores,
            sparse=parse_sparse(merged.get("ucm_sparse_config")),
            extra=merged,
            config_file=config_file,
            async_prefix_loads=_true_false_auto(merged, ASYNC_PREFIX_LOADS_KEY),
            prefetch_chunks=_true_false_auto(merged, PREFETCH_CHUNKS_KEY, False),
            use_layerwise=_true_false(merged, LAYERWISE_KEY, True),
        )


def _true_false(merged: Mapping[str, Any], key: str, default: bool) -> bool:
    value = merged.get(key, default)
    if not isinstance(value, bool):
        raise UCMConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _true_false_auto(merged: Mapping[str, Any], key: str, default: bool | str = "auto") -> bool | str:
    value = merged.get(key, default)
    if not (isinstance(value, bool) or value == "auto"):
        raise UCMConfigError(f"{key} must be true, false or \"auto\", got {value!r}")
    return value
