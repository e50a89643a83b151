"""High-KV-deviation (HKVD) token selection, CacheBlend's recompute rule.

At the check layer the freshly computed KV of every prompt token is compared
with the loaded KV (the integration compares V, as CacheBlend's own kernels
do). Tokens whose stored KV deviates most are the ones whose cross-chunk
attention matters, so only the top ``ratio`` of each request's cache-hit chunk
tokens is recomputed in later layers; everything that has no stored KV (cache
misses, the suffix, requests not blending) is always computed. The ranking
score may also be weighted by the question's attention (query_probe.py).

Batch layout: a flat token axis holding requests back to back, each token
tagged with ``segment_ids`` (its request's index in the batch, 0-based).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ucm.sparse.blend.vocabulary import check_ratio

__all__ = [
    "token_deviation",
    "num_to_select",
    "select_hkvd",
    "hkvd_candidates",
    "compute_mask",
]


def token_deviation(fresh_k: torch.Tensor, loaded_k: torch.Tensor) -> torch.Tensor:  # K or V
    """Per-token squared L2 distance over heads and dims, ``[n]`` float32.

    Squared (not plain) L2 so that per-rank partial sums over a tensor-parallel
    head shard add up to the full value with one all-reduce.
    """
    if fresh_k.shape != loaded_k.shape or fresh_k.dim() < 2:
        raise ValueError(
            f"fresh_k {tuple(fresh_k.shape)} and loaded_k {tuple(loaded_k.shape)} "
            "must both be [num_tokens, num_heads, head_size]"
        )
    diff = fresh_k.float() - loaded_k.float()
    return diff.square().flatten(1).sum(dim=1)


def token_deviation_l1(fresh: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """Per-token L1 distance over heads and dims, ``[n]`` float32 (partial sums over a
    tensor-parallel head shard add up, as with `token_deviation`)."""
    if fresh.shape != loaded.shape or fresh.dim() < 2:
        raise ValueError(f"fresh {tuple(fresh.shape)} and loaded {tuple(loaded.shape)} must both be "
                         "[num_tokens, num_heads, head_size]")
    return (fresh.float() - loaded.float()).abs().flatten(1).sum(dim=1)


def num_to_select(ratio: float, num_candidates: int) -> int:
    """How many of ``num_candidates`` tokens a ``ratio`` recomputes.

    ``ceil(ratio * n)``, with products within 1e-6 of an integer snapped to it
    (so 0.15 * 100 is 15, not 16). Ceil rather than floor: any positive ratio
    recomputes at least one token of a request that has candidates, so short
    chunks are never left completely stale. ratio 0 -> none, 1 -> all.
    """
    check_ratio(ratio)
    return min(num_candidates, max(0, math.ceil(ratio * num_candidates - 1e-6)))


def select_hkvd(
    deviation: torch.Tensor,
    candidate: torch.Tensor,
    segment_ids: torch.Tensor,
    ratio: float | torch.Tensor,
    all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Per request, the top ``num_to_select(ratio, #candidates)`` candidates by deviation.

    ``ratio`` is one float or a ``[num_segments]`` tensor of per-request ratios.
    ``all_reduce`` (tensor parallelism) must SUM the per-rank deviation across
    ranks; it runs first so every rank selects the same tokens. It may return
    the result or reduce in place and return None (``torch.distributed.all_reduce``).
    Ties go to the lower token index (earlier position). NaN deviations rank
    highest (recomputing a token is always safe). ``num_segments`` avoids a
    device sync when given. Returns a ``[n]`` bool mask, a subset of ``candidate``.
    """
    n = deviation.shape[0]
    if deviation.dim() != 1 or candidate.shape != (n,) or segment_ids.shape != (n,):
        raise ValueError(
            f"deviation {tuple(deviation.shape)}, candidate {tuple(candidate.shape)} and "
            f"segment_ids {tuple(segment_ids.shape)} must all be [num_tokens]"
        )
    if candidate.dtype != torch.bool:
        raise ValueError(f"candidate must be a bool tensor, got {candidate.dtype}")
    device = deviation.device
    deviation = deviation.float()
    if all_reduce is not None:
        reduced = all_reduce(deviation)
        if reduced is not None:
            deviation = reduced
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=device)

    segment_ids = segment_ids.to(device=device, dtype=torch.long)
    candidate = candidate.to(device)
    if num_segments is None:
        num_segments = int(segment_ids.max()) + 1
    ratios = _ratios(ratio, num_segments, device)

    # Order tokens by (segment, candidates first, deviation desc, index asc)
    # with stable sorts from the least significant key up.
    score = torch.nan_to_num(deviation, nan=float("inf"))
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.sort((~candidate[order]).to(torch.uint8), stable=True).indices]
    order = order[torch.sort(segment_ids[order], stable=True).indices]

    seg_sorted = segment_ids[order]
    seg_sizes = torch.bincount(segment_ids, minlength=num_segments)
    seg_starts = torch.cumsum(seg_sizes, 0) - seg_sizes
    rank = torch.arange(n, device=device) - seg_starts[seg_sorted]

    num_cand = torch.bincount(segment_ids, weights=candidate.double(), minlength=num_segments)
    k = torch.ceil(ratios * num_cand - 1e-6).clamp_(min=0)
    k = torch.minimum(k, num_cand).long()

    selected = torch.zeros(n, dtype=torch.bool, device=device)
    selected[order] = rank < k[seg_sorted]
    return selected


def hkvd_candidates(
    cache_hit: torch.Tensor, suffix: torch.Tensor, blending: torch.Tensor
) -> torch.Tensor:
    """Tokens eligible for HKVD selection: loaded chunk KV of a blending request."""
    return cache_hit & ~suffix & blending


def compute_mask(
    hkvd: torch.Tensor,
    cache_hit: torch.Tensor,
    suffix: torch.Tensor,
    blending: torch.Tensor,
) -> torch.Tensor:
    """Tokens computed after the check layer (all per-token bool ``[n]``).

    ``hkvd`` selected tokens, every token without loaded KV (``~cache_hit``:
    cache-miss chunk tokens), every ``suffix`` token, and every token of a
    request that is not ``blending`` (those run plain attention throughout).
    """
    shapes = {t.shape for t in (hkvd, cache_hit, suffix, blending)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"all masks must be the same [num_tokens] shape, got {shapes}")
    return (hkvd & cache_hit) | ~cache_hit | suffix | ~blending


def _ratios(ratio: float | torch.Tensor, num_segments: int, device: torch.device) -> torch.Tensor:
    if isinstance(ratio, torch.Tensor):
        if ratio.shape != (num_segments,):
            raise ValueError(
                f"per-request ratio must be [{num_segments}], got {tuple(ratio.shape)}"
            )
        r = ratio.to(device=device, dtype=torch.float64)
        if not bool(((r >= 0) & (r <= 1)).all()):
            raise ValueError("per-request ratios must be in [0, 1]")
        return r
    check_ratio(float(ratio))
    return torch.full((num_segments,), float(ratio), dtype=torch.float64, device=device)
