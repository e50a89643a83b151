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
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import yaml

from ucm.store.config import near_miss

from ucm.sparse.blend.admission import ADAPTIVE, ADMISSION_POLICIES
from ucm.sparse.blend.vocabulary import Selection, check_chunk_start_tokens, is_ratio, kv_shift_share

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "UCM_CONFIG_FILE"  # both the env var and the key inside the extra config
EXTRA_NAME = "kv_connector_extra_config"
# Top-level keys this module understands; anything else is kept in `UCMConfig.extra` and warned about.
KNOWN_TOP_LEVEL_KEYS = frozenset({"ucm_connectors", "ucm_sparse_config", CONFIG_FILE_KEY})
# Top-level keys of UCM's own connector config that mean nothing here: accepted, with a note, so a
# config written for UCM runs unchanged.
UCM_NO_EFFECT_TOP_LEVEL_KEYS = frozenset({"load_only_first_rank", "use_layerwise", "metrics_config_path"})

# How Blend ranks the loaded tokens it recomputes (compute_meta[...]["selection"]): "query" weighs
# each token's deviation by the attention the question pays it (ucm/sparse/blend/query_probe.py);
# "hkvd" is CacheBlend's deviation-only rule; "oracle" is a diagnostic, slower than full prefill:
# it runs a full prefill first and ranks by what that shows (query_probe.oracle_layer_score), a
# reference for how well a ranking could do at a given ratio.
# (ucm/sparse/blend/vocabulary.py defines them; these are their public names.)
QUERY_SELECTION = Selection.QUERY.label
HKVD_SELECTION = Selection.HKVD.label
ORACLE_SELECTION = Selection.ORACLE.label
BLEND_SELECTIONS = Selection.labels()

# Per-request parameters, in SamplingParams(extra_args={"kv_transfer_params": {...}}) or the OpenAI
# server's `kv_transfer_params` (ucm_sparse_config.Blend.request_params says which are honoured):
CHUNK_LENGTHS_PARAM = "ucm_chunk_lengths"  # chunk lengths in tokens, for chunks without a marker token
DISABLE_BLEND_PARAM = "ucm_disable_blend"  # computed in full (chunks still stored; prefix caching on)
RATIO_PARAM = "ucm_blend_ratio"  # recompute ratio in [0, 1]
SELECTION_PARAM = "ucm_blend_selection"  # one of BLEND_SELECTIONS
# false: the store's exact prefix is left unused, so the request blends from its first chunk
# (benchmarks and tests measure Blend alone with it; vLLM's own prefix cache is not affected).
EXACT_PREFIX_PARAM = "ucm_exact_prefix"
# Which missed chunks are stored (ucm_sparse_config.Blend.chunk_store): "any" stores a chunk's KV
# from whatever prompt first computed it, so the text before it shapes what later requests reuse;
# "alone" stores only chunks computed with nothing before them (a prompt's first chunk, e.g. an
# indexing request that sends the chunk by itself), so no user's text shapes another's reuse.
CHUNK_STORE_POLICIES = ("any", "alone")
CHUNK_START_TOKENS_PARAM = "ucm_chunk_start_tokens"  # tokens per loaded chunk recomputed before any ranking
KV_SHIFT_DEFAULT = 0.5  # compute_meta kv_shift when absent: half the chunk mean (docs/research.md, "A share of the mean")
# ucm_sparse_config.Blend.min_hit_share when absent: a request blends only when at least this share of
# its tokens after the exact prefix has chunk KV stored (fewer hits: vLLM computes it as usual).
MIN_HIT_SHARE_DEFAULT = 0.25
# Default cap on a step's Blend rows, per token of vLLM's step budget: with the server's 2048 on CPU,
# 8192 rows hold a whole 6k-token RAG region (misses and question included) in one step, so a
# blended request is rarely cut and loses no reuse (docs/serving.md, "Bounded steps").
STEP_CAP_PER_BUDGET = 4
KV_SHIFT_PARAM = "ucm_kv_shift"  # share in [0, 1] of its chunk's mean error the reused KV is moved by (kv_shift.py)
# true: store the request's KV on its first sighting, as an indexing request's (ucm_sparse_config.Blend.admission).
INDEX_PARAM = "ucm_index"
REQUEST_PARAMS = (CHUNK_LENGTHS_PARAM, DISABLE_BLEND_PARAM, RATIO_PARAM, SELECTION_PARAM, EXACT_PREFIX_PARAM,
                  CHUNK_START_TOKENS_PARAM, KV_SHIFT_PARAM, INDEX_PARAM)

# The keys of ucm_sparse_config.Blend and of one compute_meta entry (docs/configuration.md lists each).
BLEND_KEYS = frozenset({"chunk_end_token_id", "chunk_separator", "compute_meta", "max_step_tokens", "request_params", "allow_oracle",
                        "chunk_store", "min_hit_share", "chunk_refs", "background_chunks", "admission"})
LAYER_META_KEYS = frozenset({"ratio", "selection", "chunk_start_tokens", "kv_shift"})

_ATTN_LAYER_RE = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.self_attn\.attn")
_ATTN_LAYER_EXAMPLE = "model.layers.1.self_attn.attn"


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


# -- stores ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSpec:
    """One `ucm_connectors` entry; `config` is handed unchanged to `ucm.store.create_store`."""

    name: str
    config: dict[str, Any]

    @classmethod
    def from_dict(cls, entry: Any, path: str) -> StoreSpec:
        entry = _mapping(entry, path)
        _warn_unknown(entry, {"ucm_connector_name", "ucm_connector_config"}, path)
        name = _require(entry, "ucm_connector_name", path)
        if not isinstance(name, str):
            raise UCMConfigError(f"{path}.ucm_connector_name must be a str, got {_type_name(name)}")
        config = _mapping(_require(entry, "ucm_connector_config", path), f"{path}.ucm_connector_config")
        _validate_store(name, config, path)
        return cls(name=name, config=dict(config))


def _validate_store(name: str, config: Mapping[str, Any], path: str) -> None:
    """Runs the store's own parser now, so bad store keys fail at start-up, not at first use.

    `ucm.store.factory` only exposes builders (`STORES`), not validators, so: UcmNfsStore is checked
    with `NfsStoreConfig.from_dict` (no I/O); UcmDramStore with its builder, which allocates nothing
    up front; any other registered store is only checked when it is built.
    """
    from ucm.store.config import NfsStoreConfig
    from ucm.store.factory import STORES

    if name not in STORES:
        raise UCMConfigError(
            f"{path}.ucm_connector_name: unknown store {name!r}; known stores: {', '.join(sorted(STORES))}"
        )
    validators: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "UcmNfsStore": NfsStoreConfig.from_dict,
        "UcmDramStore": STORES["UcmDramStore"],
    }
    validate = validators.get(name)
    if validate is None:
        return
    try:
        validate(config)
    except UCMConfigError:
        raise
    except ValueError as e:
        raise UCMConfigError(f"{path}.ucm_connector_config: {e}") from e


# -- sparse methods --------------------------------------------------------------------------------


def _later_checks(meta: Mapping, meta_path: str, layers: list[tuple[int, str]],
                  first_ratio: float) -> tuple[tuple[int, float], ...]:
    """The check layers after the first (CacheBlend's gradual filtering): each takes a ratio only,
    no larger than the one before it (the selection only narrows with depth)."""
    out, previous = [], first_ratio
    for index, name in layers:
        layer_path = _key(meta_path, name)
        entry = _mapping(meta[name], layer_path)
        first_only = sorted(set(entry) & (LAYER_META_KEYS - {"ratio"}))
        if first_only:
            raise UCMConfigError(f"{layer_path}: {', '.join(first_only)} belong(s) to the first check layer "
                                 f"only; a later check layer takes a ratio")
        _warn_unknown(entry, {"ratio"}, layer_path)
        ratio = _require(entry, "ratio", layer_path)
        if not is_ratio(ratio):
            raise UCMConfigError(f"{layer_path}.ratio must be a number in [0, 1], got {ratio!r}")
        if float(ratio) > previous:
            raise UCMConfigError(f"{layer_path}.ratio {ratio} is above the ratio of the check layer before it "
                                 f"({previous}): ratios must not increase with depth (the selection only narrows)")
        out.append((index, float(ratio)))
        previous = float(ratio)
    return tuple(out)


@dataclass(frozen=True)
class BlendConfig:
    """CacheBlend settings.

    At the check layer every prompt token's KV is recomputed and compared with the loaded KV; only
    the top `ratio` of cache-hit tokens, ranked as `selection` says, are recomputed in the layers
    after it. `chunk_end_token_id` None means chunk boundaries come only from per-request parameters.
    """

    name: ClassVar[str] = "Blend"

    chunk_end_token_id: int | None
    check_layer_name: str
    check_layer: int
    ratio: float
    selection: str = QUERY_SELECTION
    # Tokens at the start of every loaded chunk that are always recomputed (EPIC), within the ratio
    # for the ranked rules; None: 16 for "chunk_start" (all it recomputes), 0 for the ranked rules.
    chunk_start_tokens: int | None = None
    # Move the stored KV of the tokens not recomputed by this share of their chunk's mean error,
    # measured on its recomputed tokens at every layer from the check layer on (sparse/blend/kv_shift.py);
    # 0: off. true is 1 and false 0. Default 0.5, the share that brought the next-token KL to full
    # prefill lowest for little time (docs/research.md, "A share of the mean").
    kv_shift: float = KV_SHIFT_DEFAULT
    # Cap on the rows the Blend forward runs outside vLLM's step budget (misses inside the
    # blended region and the recomputed share), summed over the requests blended in one step;
    # None: 4 x vLLM's max_num_batched_tokens. A region with more is cut to fit (docs/serving.md).
    max_step_tokens: int | None = None
    # Per-request parameters (kv_transfer_params) the connector honours; None: all of them from
    # the offline API, none from an API server (the operator lists what clients may set).
    request_params: tuple[str, ...] | None = None
    # Whether a request may ask for the diagnostic "oracle" selection (a full prefill first);
    # None: from the offline API only.
    allow_oracle: bool | None = None
    chunk_store: str = "any"  # one of CHUNK_STORE_POLICIES
    # A chunk block whose KV the same prompt stores as exact prefix blocks is stored as a reference
    # to those rows (sparse/blend/chunk_refs.py) instead of a second copy of its KV; false: a copy.
    chunk_refs: bool = True
    # Blend runs only when at least this share of the tokens after the exact prefix has chunk KV in
    # the store; below it the request is left to vLLM's own prefill (chunked, within its budget),
    # reported as fallback "few_hits": with few hits the probe, the loads and one long step of
    # misses cost more than the reuse saves (docs/serving.md).
    min_hit_share: float = MIN_HIT_SHARE_DEFAULT
    # Compute the chunks a request missed again, alone, while the engine has no request to serve,
    # so they are stored (BlendFirstScheduler; connector/background_chunks.py). None: on under the
    # "alone" policy, where nothing else stores a chunk that arrives after other text.
    background_chunks: bool | None = None
    # Which computed KV is stored (sparse/blend/admission.py): "second_sighting" stores a chunk (or a
    # prompt's suffix) only when it was computed before, here or by another instance sharing the
    # store, and records a sighting of a few bytes the first time; a prompt ending with a chunk (an
    # indexing request) or sent with ucm_index stores everything. "first_sighting": everything, always.
    # "adaptive": first sighting while this engine's recent chunk lookups find enough, else second.
    admission: str = ADAPTIVE
    # Token ids (or text, tokenized once with the model's tokenizer when the engine starts:
    # `with_separator_ids`) whose every occurrence ends a chunk, LMCache's special string; the
    # separator belongs to the chunk before it. Excludes chunk_end_token_id.
    chunk_separator: tuple[int, ...] | str | None = None
    # CacheBlend's gradual filtering: (layer, ratio) of each check layer after the first, deeper
    # and with a ratio no larger: there the selected rows' V deviation is measured again (their
    # fresh KV is computed there anyway) and the selection narrows to that ratio of the loaded
    # tokens; rows dropped keep their loaded KV from that layer on. Empty: one check layer.
    later_checks: tuple[tuple[int, float], ...] = ()

    @property
    def computes_missed_chunks_alone(self) -> bool:
        return self.background_chunks if self.background_chunks is not None else self.chunk_store == "alone"

    def step_cap(self, step_budget: int) -> int:
        """Rows the Blend forward may run beside vLLM's scheduled ones in one step (docs/serving.md)."""
        return self.max_step_tokens or STEP_CAP_PER_BUDGET * step_budget

    def __post_init__(self) -> None:
        # Guards direct construction: the two spellings of the check layer must agree.
        if self.check_layer_name != attn_layer_name(self.check_layer):
            raise UCMConfigError(
                f"BlendConfig: check_layer_name {self.check_layer_name!r} does not match check_layer {self.check_layer}"
            )

    @classmethod
    def from_dict(cls, d: Any, path: str = "ucm_sparse_config.Blend") -> BlendConfig:
        d = _mapping(d, path)
        _warn_unknown(d, BLEND_KEYS, path)
        admission = d.get("admission", ADAPTIVE)
        if admission not in ADMISSION_POLICIES:
            raise UCMConfigError(f"{path}.admission must be one of {', '.join(map(repr, ADMISSION_POLICIES))}, "
                                 f"got {admission!r}")
        chunk_store = d.get("chunk_store", "any")
        if chunk_store not in CHUNK_STORE_POLICIES:
            raise UCMConfigError(f"{path}.chunk_store must be one of {', '.join(map(repr, CHUNK_STORE_POLICIES))}, "
                                 f"got {chunk_store!r}")
        request_params = d.get("request_params")
        if request_params is not None:
            if not isinstance(request_params, (list, tuple)) or any(p not in REQUEST_PARAMS for p in request_params):
                raise UCMConfigError(f"{path}.request_params must be a list of per-request parameter names from "
                                     f"{', '.join(REQUEST_PARAMS)}, got {request_params!r}")
            request_params = tuple(request_params)
        chunk_refs = d.get("chunk_refs", True)
        if not isinstance(chunk_refs, bool):
            raise UCMConfigError(f"{path}.chunk_refs must be true or false (or absent), got {chunk_refs!r}")
        background_chunks = d.get("background_chunks")
        if background_chunks is not None and not isinstance(background_chunks, bool):
            raise UCMConfigError(f"{path}.background_chunks must be true or false (or absent), got {background_chunks!r}")
        allow_oracle = d.get("allow_oracle")
        if allow_oracle is not None and not isinstance(allow_oracle, bool):
            raise UCMConfigError(f"{path}.allow_oracle must be true or false (or absent), got {allow_oracle!r}")
        min_hit_share = d.get("min_hit_share", MIN_HIT_SHARE_DEFAULT)
        if not is_ratio(min_hit_share):
            raise UCMConfigError(f"{path}.min_hit_share must be a number in [0, 1], got {min_hit_share!r}")
        cap = d.get("max_step_tokens")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise UCMConfigError(f"{path}.max_step_tokens must be a positive int (or absent), got {cap!r} "
                                 f"({_type_name(cap)})")

        token = d.get("chunk_end_token_id")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
            raise UCMConfigError(
                f"{path}.chunk_end_token_id must be a non-negative int (or absent), got {token!r} "
                f"({_type_name(token)})"
            )
        separator = d.get("chunk_separator")
        if separator is not None:
            if token is not None:
                raise UCMConfigError(f"{path}: give chunk_end_token_id or chunk_separator, not both")
            if isinstance(separator, (list, tuple)) and separator and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in separator):
                separator = tuple(separator)
            elif not (isinstance(separator, str) and separator):
                raise UCMConfigError(f"{path}.chunk_separator must be a non-empty list of token ids or a non-empty "
                                     f"string, got {separator!r} ({_type_name(separator)})")

        meta_path = f"{path}.compute_meta"
        meta = _mapping(_require(d, "compute_meta", path), meta_path)
        example = f'{{"{_ATTN_LAYER_EXAMPLE}": {{"ratio": 0.2}}}}'
        if not meta:
            raise UCMConfigError(f"{meta_path} must name at least one check layer, e.g. {example}")
        layers = []
        for name in meta:
            match = _ATTN_LAYER_RE.fullmatch(name) if isinstance(name, str) else None
            if match is None:
                raise UCMConfigError(
                    f"{meta_path} key {name!r} is not an attention layer name; "
                    f"expected model.layers.<i>.self_attn.attn, e.g. {example}"
                )
            layers.append((int(match.group(1)), name))
        layers.sort()
        if len({index for index, _ in layers}) != len(layers):
            raise UCMConfigError(f"{meta_path} names one layer twice: {[name for _, name in layers]}")
        layer_index, layer_name = layers[0]
        layer_meta = meta[layer_name]
        layer_path = _key(meta_path, layer_name)
        layer_meta = _mapping(layer_meta, layer_path)
        _warn_unknown(layer_meta, LAYER_META_KEYS, layer_path)
        kv_shift = kv_shift_share(layer_meta.get("kv_shift", KV_SHIFT_DEFAULT))
        if kv_shift is None:
            raise UCMConfigError(f"{layer_path}.kv_shift must be a number in [0, 1] (or true / false), "
                                 f"got {layer_meta['kv_shift']!r}")
        ratio = _require(layer_meta, "ratio", layer_path)
        if not is_ratio(ratio):
            raise UCMConfigError(f"{layer_path}.ratio must be a number in [0, 1], got {ratio!r}")
        selection = layer_meta.get("selection", QUERY_SELECTION)
        if Selection.parse(selection) is None:
            raise UCMConfigError(
                f"{layer_path}.selection must be one of {', '.join(map(repr, BLEND_SELECTIONS))}, got {selection!r}"
            )
        chunk_start_tokens = layer_meta.get("chunk_start_tokens")
        why = None if chunk_start_tokens is None else check_chunk_start_tokens(Selection.parse(selection),
                                                                               chunk_start_tokens)
        if why:
            raise UCMConfigError(f"{layer_path}.chunk_start_tokens {why}")
        later_checks = _later_checks(meta, meta_path, layers[1:], float(ratio))

        return cls(
            chunk_end_token_id=token,
            chunk_separator=separator,
            check_layer_name=layer_name,
            check_layer=layer_index,
            later_checks=later_checks,
            ratio=float(ratio),
            selection=selection,
            chunk_start_tokens=chunk_start_tokens,
            kv_shift=kv_shift,
            max_step_tokens=cap,
            request_params=request_params,
            allow_oracle=allow_oracle,
            chunk_store=chunk_store,
            chunk_refs=chunk_refs,
            min_hit_share=float(min_hit_share),
            background_chunks=background_chunks,
            admission=admission,
        )

    def validate_for_model(self, num_layers: int, vocab_size: int, path: str = "ucm_sparse_config.Blend") -> None:
        """Checks what only the loaded model can tell: the check layer and the token id exist.

        A check layer that is the model's last layer is allowed (output equals full recompute) but
        warned about, since no later layer is left to save work on.
        """
        if not 0 <= self.check_layer < num_layers:
            valid = f" ({attn_layer_name(0)} .. {attn_layer_name(num_layers - 1)})" if num_layers > 0 else ""
            raise UCMConfigError(
                f"{path}.compute_meta: check layer {self.check_layer_name!r} does not exist; "
                f"the model has {num_layers} layers{valid}"
            )
        for layer, _ in self.later_checks:
            if layer >= num_layers:
                raise UCMConfigError(f"{path}.compute_meta: check layer {attn_layer_name(layer)!r} does not exist; "
                                     f"the model has {num_layers} layers")
        if self.check_layer == num_layers - 1:
            logger.warning(
                "%s.compute_meta: check layer %r is the model's last layer; Blend saves no compute",
                path,
                self.check_layer_name,
            )
        if self.chunk_end_token_id is not None and self.chunk_end_token_id >= vocab_size:
            raise UCMConfigError(
                f"{path}.chunk_end_token_id {self.chunk_end_token_id} is outside the model's vocabulary "
                f"(size {vocab_size})"
            )
        if isinstance(self.chunk_separator, tuple) and max(self.chunk_separator) >= vocab_size:
            raise UCMConfigError(f"{path}.chunk_separator {list(self.chunk_separator)} holds an id outside the model's "
                                 f"vocabulary (size {vocab_size})")

    @property
    def chunk_end(self) -> tuple[int, ...] | None:
        """The token sequence that ends a chunk (None: chunks come from per-request lengths only)."""
        if self.chunk_end_token_id is not None:
            return (self.chunk_end_token_id,)
        if isinstance(self.chunk_separator, str):
            raise UCMConfigError("ucm_sparse_config.Blend.chunk_separator text was not tokenized "
                                 "(with_separator_ids) before use")
        return self.chunk_separator

    def with_separator_ids(self, tokenize: Callable[[str], list[int]]) -> BlendConfig:
        """This config with a text `chunk_separator` replaced by its token ids (the model's
        tokenizer, no special tokens added); the text must tokenize the same inside prompts."""
        if not isinstance(self.chunk_separator, str):
            return self
        ids = tuple(int(t) for t in tokenize(self.chunk_separator))
        if not ids:
            raise UCMConfigError(f"ucm_sparse_config.Blend.chunk_separator {self.chunk_separator!r} tokenizes to "
                                 "no tokens")
        logger.info("Blend chunk separator %r is tokens %s", self.chunk_separator, list(ids))
        return dataclasses.replace(self, chunk_separator=ids)


# A parsed sparse method's config; a union once more methods are registered.
SparseSpec: TypeAlias = BlendConfig

# Sparse method name -> parser(dict, key path). Register new methods here.
SPARSE_METHODS: dict[str, Callable[[Any, str], SparseSpec]] = {
    BlendConfig.name: BlendConfig.from_dict,
}


def parse_sparse(value: Any, path: str = "ucm_sparse_config") -> SparseSpec | None:
    """`ucm_sparse_config` names zero or one method; absent, None or {} means no sparse method."""
    if value is None:
        return None
    value = _mapping(value, path)
    if not value:
        return None
    if len(value) > 1:
        raise UCMConfigError(
            f"{path} must name at most one sparse method, got {len(value)}: {', '.join(sorted(map(str, value)))}"
        )
    ((method, method_config),) = value.items()
    parser = SPARSE_METHODS.get(method)
    if parser is None:
        raise UCMConfigError(
            f"{path}: unknown sparse method {method!r}; known methods: {', '.join(sorted(SPARSE_METHODS))}"
        )
    return parser(method_config, f"{path}.{method}")


# -- top level -------------------------------------------------------------------------------------


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
    """

    stores: tuple[StoreSpec, ...]
    sparse: SparseSpec | None
    extra: dict[str, Any]
    config_file: str | None = None

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
        )
