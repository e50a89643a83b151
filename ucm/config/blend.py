"""`ucm_sparse_config`: the Blend method's settings (BlendConfig), parsed and checked."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from ucm.config.checks import UCMConfigError, _key, _mapping, _require, _type_name, _warn_unknown, attn_layer_name
from ucm.config.names import (BLEND_KEYS, BLEND_SELECTIONS, CHUNK_STORE_POLICIES, KV_SHIFT_DEFAULT,
                              KV_SHIFT_SAMPLE_DEFAULT, LAYER_META_KEYS,
                              MIN_HIT_SHARE_DEFAULT, QUERY_SELECTION, REQUEST_PARAMS, STEP_CAP_PER_BUDGET)
from ucm.sparse.blend.admission import ADAPTIVE, ADMISSION_POLICIES
from ucm.sparse.blend.vocabulary import (MAX_SHIFT_SAMPLE, Selection, check_chunk_start_tokens, is_ratio,
                                          kv_shift_share, shift_sample_share)

logger = logging.getLogger(__name__)

_ATTN_LAYER_RE = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.self_attn\.attn")
_ATTN_LAYER_EXAMPLE = "model.layers.1.self_attn.attn"


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
    # Share of every loaded chunk's tokens, evenly spaced, recomputed first (within the ratio) to
    # estimate the shift from them alone: the ranked tokens are the stalest, so their mean error is
    # biased (docs/research.md, "An unbiased sample for the shift"). 0: estimated from the ranked tokens.
    kv_shift_sample: float = KV_SHIFT_SAMPLE_DEFAULT
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
        kv_shift_sample = shift_sample_share(layer_meta.get("kv_shift_sample", KV_SHIFT_SAMPLE_DEFAULT))
        if kv_shift_sample is None:
            raise UCMConfigError(f"{layer_path}.kv_shift_sample must be a number in [0, {MAX_SHIFT_SAMPLE:g}], "
                                 f"got {layer_meta['kv_shift_sample']!r}")
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
            kv_shift_sample=kv_shift_sample,
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
