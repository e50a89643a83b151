"""Chunk-mean KV shift: correct the stored KV of the tokens Blend does not recompute.

A chunk's stored KV was computed without the text that now precedes it. At every layer the
tokens Blend recomputes show how far their stored K and V are from the fresh ones; a large part
of that error is common to the whole chunk (with full prefill as the reference, the chunk's mean
error holds a large share of the error energy of K and V in the middle layers: docs/research.md,
benchmarks/reuse_study.py). So at each layer the mean error of a chunk's recomputed tokens is
added to the stored KV of its other tokens before attention reads it. K is compared before RoPE
(errors un-rotated by each token's position, the mean rotated to each target's position), since
rotated errors at different positions do not average.

Per layer and chunk: ``dk = mean_i R(-p_i) (k_fresh_i - k_stored_i)``, ``dv = mean_i (v_fresh_i -
v_stored_i)`` over the chunk's recomputed tokens i, then ``k_j += s R(p_j) dk`` and ``v_j += s dv``
for its other tokens j, with a share ``s`` in [0, 1]. A chunk none of whose tokens is recomputed is
left as stored.

Why a share below 1: the recomputed tokens are the ones ranked stalest, so their mean error
likely overshoots the typical token's (docs/research.md, "A share of the mean"). An unbiased
estimate instead: an evenly spaced sample of each chunk's tokens recomputed within the ratio
(`kv_shift_sample`), whose mean error alone is the chunk's estimate (`shift_sources`).
"""

from __future__ import annotations

import torch

from ucm.sparse.blend.rope import Rotation

__all__ = ["chunk_mean_errors", "kv_shifts", "sampled_offsets", "shift_sources"]


def chunk_mean_errors(
    fresh_k: torch.Tensor,
    stored_k: torch.Tensor,
    fresh_v: torch.Tensor,
    stored_v: torch.Tensor,
    chunk: torch.Tensor,
    num_chunks: int,
    unrotate: Rotation,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk, the mean error of its recomputed tokens: ``(dk, dv, has)``.

    Inputs are the recomputed tokens' ``[n, heads, head_size]`` fresh and stored K (after RoPE)
    and V, ``chunk`` ``[n]`` (their chunk index in ``[0, num_chunks)``) and `unrotate`, the
    rotations back from their positions (``Rotation.of(-positions, ...)``). ``dk`` (before RoPE)
    and ``dv`` are ``[num_chunks, heads, head_size]`` float32; ``has`` ``[num_chunks]`` bool says
    which chunks had a recomputed token.
    """
    n = fresh_k.shape[0]
    if not (stored_k.shape == fresh_k.shape and fresh_v.shape == stored_v.shape and fresh_v.shape[0] == n
            and chunk.shape == (n,) and unrotate.cos.shape[0] == n):
        raise ValueError(f"fresh/stored K {tuple(fresh_k.shape)}/{tuple(stored_k.shape)}, V {tuple(fresh_v.shape)}/"
                         f"{tuple(stored_v.shape)}, chunk {tuple(chunk.shape)} and rotations "
                         f"{unrotate.cos.shape[0]} must cover the same tokens")
    device = fresh_k.device
    err_k = unrotate.apply(fresh_k.float() - stored_k.float())
    err_v = fresh_v.float() - stored_v.float()
    chunk = chunk.long()
    dk = torch.zeros(num_chunks, *fresh_k.shape[1:], dtype=torch.float32, device=device)
    dv = torch.zeros(num_chunks, *fresh_v.shape[1:], dtype=torch.float32, device=device)
    dk.index_add_(0, chunk, err_k)
    dv.index_add_(0, chunk, err_v)
    count = torch.bincount(chunk, minlength=num_chunks)
    scale = 1.0 / count.clamp(min=1).float()
    return dk * scale[:, None, None], dv * scale[:, None, None], count > 0


def kv_shifts(
    chunk: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    weight: torch.Tensor,
    rotate: Rotation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What to add to the stored K (after RoPE) and V of tokens not recomputed, ``[m, heads,
    head_size]`` float32 each: `weight` (``[num_chunks]``, the share applied; 0 where the chunk
    has no estimate) times their chunk's mean error (`chunk_mean_errors`), K rotated to their
    positions (`rotate`); zero for ``chunk == num_chunks`` (slots that are not moved)."""
    zero = dk.new_zeros(1, *dk.shape[1:])
    weight = weight.to(dk.dtype)[:, None, None]
    dk = torch.cat([dk * weight, zero])
    dv = torch.cat([dv * weight, zero])
    chunk = chunk.long()
    return rotate.apply(dk[chunk]), dv[chunk]


def sampled_offsets(offsets: torch.Tensor, stride: int) -> torch.Tensor:
    """``[n]`` bool: the tokens at `offsets` within their chunk (-1: in none) that an evenly spaced
    sample takes, every `stride`-th from half a stride in (so a chunk's first token, often a
    formatting token, is not one)."""
    return (offsets >= 0) & (offsets % stride == stride // 2)


def shift_sources(chunk: torch.Tensor, sample: torch.Tensor, sampling: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """``[n]`` bool: which recomputed rows estimate their chunk's mean error. ``chunk`` is each
    recomputed row's loaded chunk (-1: not a loaded row), ``sample`` marks sample rows,
    ``sampling`` the rows of requests estimating from a sample. Such a request's chunk is
    estimated from its sample rows alone; one with no sample row recomputed (shorter than half a
    stride) from its other recomputed rows, as without sampling."""
    in_chunk = chunk >= 0
    sampled = torch.zeros(num_chunks + 1, dtype=torch.bool, device=chunk.device)
    sampled[chunk[in_chunk & sample]] = True
    return in_chunk & (~sampling | sample | ~sampled[chunk])
