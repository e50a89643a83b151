"""Exact causal attention for queries at scattered positions of one sequence, tiled.

Blend recomputes a few hundred tokens spread over a long prompt, mostly in runs of one to three
consecutive positions. Given one pseudo-request per run, a paged-attention kernel re-reads the
request's whole K/V for every short run and multiplies it with a handful of query rows. Here the
sorted queries are cut into tiles; each tile is one GEMM against the keys up to its last
position, and only the causal tail of the tile (keys between its first and last query) is
masked. Measured on a 2-core CPU for SmolLM2's geometry (945 queries over 6k keys): 1.35x faster
than vLLM's CPU kernel on the runs. Long runs stay with the kernel (see sparse_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TILE = 32  # queries per tile; 24-48 measured within 5% of each other


@dataclass
class Tile:
    start: int  # query rows [start, end)
    end: int
    lo: int  # position of the tile's first query: keys < lo are visible to every row
    hi: int  # last position + 1: keys >= hi are visible to none
    tail_hidden: torch.Tensor | None  # [(end - start) * group, hi - lo] bool, True = key after query


@dataclass
class TilePlan:
    """Tiles of one sequence's queries, built once and reused by every layer."""

    tiles: list[Tile]
    num_queries: int
    group: int  # query heads per KV head
    max_keys: int

    @classmethod
    def build(cls, q_pos: torch.Tensor, group: int, tile: int | None = None) -> TilePlan:
        """``q_pos``: ``[n]`` positions, non-decreasing (the rows of one request)."""
        if q_pos.dim() != 1:
            raise ValueError(f"q_pos must be 1-D, got {tuple(q_pos.shape)}")
        tile = DEFAULT_TILE if tile is None else tile
        if tile <= 0 or group <= 0:
            raise ValueError("tile and group must be positive")
        pos = q_pos.long()
        if pos.numel() > 1 and bool((pos[1:] < pos[:-1]).any()):
            raise ValueError("q_pos must be sorted (non-decreasing)")
        host = pos.tolist()
        tiles = []
        for start in range(0, len(host), tile):
            end = min(start + tile, len(host))
            lo, hi = host[start], host[end - 1] + 1
            hidden = None
            if hi - lo > 1:
                keys = torch.arange(lo, hi, device=pos.device)
                hidden = (keys[None, :] > pos[start:end, None]).repeat_interleave(group, 0)
            tiles.append(Tile(start, end, lo, hi, hidden))
        return cls(tiles, len(host), group, host[-1] + 1 if host else 0)


def tiled_causal_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, plan: TilePlan, scale: float
) -> torch.Tensor:
    """Query ``i`` attends to keys ``0 .. q_pos[i]`` of one sequence.

    ``q``: ``[n, Hq, D]`` in ``plan`` order; ``k_t``: ``[Hk, D, S]`` (K transposed, head-major,
    ``S >= plan.max_keys``); ``v``: ``[Hk, S, D]``. Query head ``h`` uses KV head ``h // group``
    (vLLM's GQA order). Computes in float32; returns ``[n, Hq, D]`` in ``q``'s dtype.
    """
    n, hq, d = q.shape
    hk, g = k_t.shape[0], plan.group
    if n != plan.num_queries or hq != hk * g:
        raise ValueError(f"q {tuple(q.shape)} does not match the plan ({plan.num_queries} queries, "
                         f"{hk} KV heads x group {g})")
    if k_t.shape[2] < plan.max_keys or v.shape[1] < plan.max_keys:
        raise ValueError(f"{plan.max_keys} keys needed, got {k_t.shape[2]}")
    # Rows of one KV head's query group side by side: [Hk, n * g, D], so a tile is a row slice.
    qg = (q.float() * scale).view(n, hk, g, d).transpose(0, 1).reshape(hk, n * g, d)
    k_t, v = k_t.float(), v.float()
    out = torch.empty(hk, n * g, d, dtype=torch.float32, device=q.device)
    rows_max = max((t.end - t.start for t in plan.tiles), default=0) * g
    scores = torch.empty(hk * rows_max * plan.max_keys, dtype=torch.float32, device=q.device)
    for t in plan.tiles:
        r0, r1 = t.start * g, t.end * g
        s = scores[: hk * (r1 - r0) * t.hi].view(hk, r1 - r0, t.hi)
        torch.bmm(qg[:, r0:r1], k_t[:, :, : t.hi], out=s)
        if t.tail_hidden is not None:
            s[:, :, t.lo:].masked_fill_(t.tail_hidden, float("-inf"))
        s.sub_(s.amax(-1, keepdim=True)).exp_()  # in place: no second score-sized buffer
        denom = s.sum(-1, keepdim=True)
        out[:, r0:r1] = torch.bmm(s, v[:, : t.hi]).div_(denom)
    return out.view(hk, n, g, d).transpose(0, 1).reshape(n, hq, d).to(q.dtype)
