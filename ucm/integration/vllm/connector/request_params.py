"""Per-request parameters: which ones a request may send, and the Blend settings it gets.

A request sends `ucm_*` keys in its kv_transfer_params (its ratio, rule, chunk-start rows, KV
shift, opt-outs). The operator lists the keys a request may send (`request_params`; behind
`ucm-vllm serve` none unless listed) and whether it may ask for the oracle. A key not allowed is
refused (reported, ignored); an allowed value that is not valid falls back to the configured one
with a warning that names it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from ucm.config import (BLEND_SELECTIONS, CHUNK_START_TOKENS_PARAM, KV_SHIFT_PARAM, KV_SHIFT_SAMPLE_PARAM,
                        ORACLE_SELECTION, RATIO_PARAM,
                        REQUEST_PARAMS, SELECTION_PARAM, BlendConfig)
from ucm.integration.vllm.plugin import API_SERVER_ENV
from ucm.sparse.blend.vocabulary import (MAX_SHIFT_SAMPLE, Selection, check_chunk_start_tokens, chunk_start_tokens_for,
                                         is_ratio, kv_shift_share, shift_sample_share)

logger = logging.getLogger(__name__)

# Key of the per-request report in RequestOutput.kv_transfer_params (not a parameter).
REPORT_KEY = "ucm"


@dataclass(frozen=True)
class BlendParams:
    """The Blend settings of one request."""

    ratio: float
    selection: str
    chunk_start_tokens: int
    kv_shift: float  # share of its chunk's mean error the reused KV is moved by
    kv_shift_sample: float = 0.0  # share of each loaded chunk's tokens, evenly spaced, that estimate the shift


class RequestParamPolicy:
    def __init__(self, blend: BlendConfig | None):
        self.blend = blend
        serving = os.environ.get(API_SERVER_ENV) == "1"
        listed = blend.request_params if blend else None
        self.allowed = frozenset(listed if listed is not None else () if serving else REQUEST_PARAMS)
        oracle = blend.allow_oracle if blend else None
        self.allow_oracle = oracle if oracle is not None else not serving

    def honoured(self, kv_transfer_params: dict | None) -> tuple[dict, tuple[str, ...]]:
        """(the per-request parameters honoured, the names of those refused)."""
        params, refused = {}, []
        for name, value in (kv_transfer_params or {}).items():
            if not (isinstance(name, str) and name.startswith("ucm_")) or name == REPORT_KEY:
                continue  # another connector's, or not ours to judge
            if (name not in self.allowed
                    or name == SELECTION_PARAM and value == ORACLE_SELECTION and not self.allow_oracle):
                refused.append(name)
            else:
                params[name] = value
        return params, tuple(refused)

    def ratio(self, request_id: str, params: dict) -> float:
        return _valid(request_id, params, RATIO_PARAM, self.blend.ratio,
                      lambda v: float(v) if is_ratio(v) else None, "must be a number in [0, 1]")

    def blend_params(self, request_id: str, params: dict, ratio: float) -> BlendParams:
        """The request's settings (its `ratio` already read by `ratio`)."""
        selection = _valid(request_id, params, SELECTION_PARAM, self.blend.selection,
                           lambda v: v if Selection.parse(v) is not None else None,
                           f"must be one of {', '.join(BLEND_SELECTIONS)}")
        rule = Selection.parse(selection)
        configured = chunk_start_tokens_for(rule, self.blend.chunk_start_tokens)
        count = params.get(CHUNK_START_TOKENS_PARAM, configured)
        why = check_chunk_start_tokens(rule, count)
        if why:
            logger.warning("request %s: %s %s; using %s", request_id, CHUNK_START_TOKENS_PARAM, why, configured)
            count = configured
        kv_shift = _valid(request_id, params, KV_SHIFT_PARAM, self.blend.kv_shift, kv_shift_share,
                          "must be a number in [0, 1] (or true / false)")
        sample = _valid(request_id, params, KV_SHIFT_SAMPLE_PARAM, self.blend.kv_shift_sample, shift_sample_share,
                        f"must be a number in [0, {MAX_SHIFT_SAMPLE:g}]")
        return BlendParams(ratio, selection, count, kv_shift, sample)


def _valid(request_id: str, params: dict, name: str, default: Any, check: Callable[[Any], Any], expected: str) -> Any:
    """`check(value)` of the request's `name`, or `default` (with a warning) where it gives None."""
    value = params.get(name, default)
    checked = check(value)
    if checked is None:
        logger.warning("request %s: %s %s, got %r; using %r", request_id, name, expected, value, default)
        return default
    return checked
