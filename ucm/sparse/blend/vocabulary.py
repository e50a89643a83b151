"""Blend's vocabulary: the selection rules and the ratio, named and checked in one place.

The configuration, per-request parameters, the scheduler, the forward and the benchmarks all
speak of the same two things: which rule ranks the loaded tokens a request recomputes, and what
share of them it recomputes.
"""

from __future__ import annotations

import enum
import math
from typing import Any


class Selection(enum.IntEnum):
    """How the loaded tokens to recompute are ranked. The value is the code the forward's
    per-request tensors carry; the public name (config, requests) is `label`."""

    QUERY = 0  # deviation weighted by the attention the question pays each token (query_probe.py)
    HKVD = 1  # deviation alone: CacheBlend's rule (hkvd.py)
    ORACLE = 2  # diagnostic: ranks by a full prefill run first (costs one on top)
    # The peers' rules, for comparison (benchmarks/blend_bench.py --pareto): deviation of the
    # check layer's K (after RoPE) instead of V, summed over heads and dims.
    KEY_L1 = 3  # absolute deviation: UCM Blend's rule
    KEY_L2 = 4  # squared deviation: LMCache's CacheBlend
    # EPIC (LegoLink): the first `chunk_start_tokens` of every loaded chunk, whatever the ratio,
    # and nothing else; no deviation is measured. (A ranked rule given `chunk_start_tokens`
    # recomputes those rows first, within its ratio, and ranks the rest.)
    CHUNK_START = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: Any) -> Selection | None:
        """The rule called `name`, or None if there is none."""
        return next((s for s in cls if s.label == name), None)

    @classmethod
    def labels(cls) -> tuple[str, ...]:
        return tuple(s.label for s in cls)


KEY_RULES = (Selection.KEY_L1, Selection.KEY_L2)  # rank by the check layer's K deviation: need its loaded K
DEFAULT_CHUNK_START_TOKENS = 16  # EPIC recomputes up to 32 tokens per chunk


def is_token_count(value: Any, minimum: int = 1) -> bool:
    """An int (not a bool) of at least `minimum`: chunk_start_tokens."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def chunk_start_tokens_for(selection: Selection, configured: int | None) -> int:
    """Tokens per loaded chunk recomputed before any ranking: `configured`, or by default
    DEFAULT_CHUNK_START_TOKENS for EPIC's rule (they are all it recomputes) and none for the
    ranked rules."""
    if selection == Selection.CHUNK_START:
        return configured if configured else DEFAULT_CHUNK_START_TOKENS
    return configured or 0


def check_chunk_start_tokens(selection: Selection, count: Any) -> str | None:
    """Why `count` is not a chunk_start_tokens for `selection` (None: it is)."""
    if selection == Selection.CHUNK_START and not is_token_count(count):
        return f"must be a positive int with selection 'chunk_start', got {count!r}"
    if not is_token_count(count, minimum=0):
        return f"must be an int >= 0, got {count!r}"
    return None


def kv_shift_share(value: Any) -> float | None:
    """The share of its chunk's mean error a reused token's KV is moved by (kv_shift.py): a number
    in [0, 1], true for 1 and false for 0; None if `value` is none of these."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value) if is_ratio(value) else None


MAX_SHIFT_SAMPLE = 0.5


def shift_sample_share(value: Any) -> float | None:
    """The share of every loaded chunk's tokens sampled, evenly spaced, to estimate its KV shift: a
    number in [0, MAX_SHIFT_SAMPLE]; None if `value` is not one."""
    return float(value) if is_ratio(value) and value <= MAX_SHIFT_SAMPLE else None


def sample_stride(share: float) -> int:
    """Every how many tokens of a chunk one is sampled at `share` (0: none)."""
    return max(1, round(1 / share)) if share > 0 else 0


def is_ratio(value: Any) -> bool:
    """A recompute ratio: a real number (not a bool) in [0, 1]."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and 0 <= value <= 1)


def check_ratio(value: Any, what: str = "ratio") -> float:
    """`value` as a ratio, or ValueError naming `what`."""
    if not is_ratio(value):
        raise ValueError(f"{what} must be a number in [0, 1], got {value!r}")
    return float(value)
