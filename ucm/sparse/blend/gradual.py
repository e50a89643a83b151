"""CacheBlend's gradual filtering: at a later check layer the selection only narrows.

At the first check layer each request selects the top `ratio` of its loaded tokens. At each later
check layer the tokens still recomputed are ranked again (their fresh KV is computed there anyway,
so the deviation costs nothing more than a projection) and each request keeps the top share of
its loaded tokens that layer allows; the others keep their loaded KV from there on. A deeper
layer's deviation predicts the error at the output better than the first's.
"""

from __future__ import annotations

import torch

from ucm.sparse.blend.hkvd import select_hkvd


def narrowed(score: torch.Tensor, ranked: torch.Tensor, kept: torch.Tensor, loaded: torch.Tensor,
             segment: torch.Tensor, request_ratios: torch.Tensor, ratio: float) -> torch.Tensor:
    """Which `ranked` rows each request keeps recomputing past a later check layer, ``[n]`` bool.

    `ranked`: loaded rows still recomputed that may be dropped; `kept`: loaded rows recomputed that
    stay whatever their score (chunk starts); `loaded`: every loaded row. A request keeps
    ``ceil(min(ratio, its own ratio) * its loaded rows)`` recomputed rows in all, the `kept` ones
    first, the rest the best-scored `ranked` ones (ties to the earlier row, as the first
    selection breaks them).
    """
    num_reqs = request_ratios.shape[0]
    count = lambda mask: torch.bincount(segment[mask], minlength=num_reqs).double()  # noqa: E731
    candidates = count(ranked)
    target = torch.ceil(torch.clamp(request_ratios.double(), max=ratio) * count(loaded) - 1e-6) - count(kept)
    # select_hkvd keeps ceil(share * candidates): half a row below the target survives its float32
    # rounding either way.
    share = ((target - 0.5) / candidates.clamp(min=1)).clamp(0.0, 1.0)
    return select_hkvd(score, ranked, segment, share.float(), num_segments=num_reqs)
