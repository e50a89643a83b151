"""Exact causal attention for scattered recomputed tokens via pseudo-requests.

After the check layer only the selected tokens are recomputed, but each must
still attend to *all* keys of its request up to its own position (the
non-selected ones come from the loaded, shifted cache). Paged attention kernels
(flash-attn varlen, vLLM backends) take each request's queries as the LAST
``q_len`` positions of ``seq_len`` keys (bottom-right causal alignment), so
that is exact only for a contiguous run of positions. We therefore split each
request's selected tokens into maximal runs of consecutive positions and
present every run as its own pseudo-request with ``seq_len = last position +
1``, sharing the owning request's block table row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "contiguous_runs",
    "PseudoBatch",
    "pseudo_request_metadata",
    "causal_attention_reference",
]


def contiguous_runs(
    positions: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Maximal runs of consecutive positions, as ``(run_starts, run_lengths)`` int64.

    ``positions`` (``[m]``) must be strictly increasing within each segment,
    segments stored back to back. ``run_starts`` are indices into
    ``positions`` (so ``positions[run_starts]`` are the first positions); a run
    also breaks where ``segment_ids`` changes.
    """
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got {tuple(positions.shape)}")
    m = positions.shape[0]
    device = positions.device
    if m == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    pos = positions.long()
    breaks = torch.ones(m, dtype=torch.bool, device=device)
    breaks[1:] = pos[1:] != pos[:-1] + 1
    if segment_ids is not None:
        if segment_ids.shape != positions.shape:
            raise ValueError("segment_ids must have the same shape as positions")
        seg = segment_ids.to(device)
        breaks[1:] |= seg[1:] != seg[:-1]
    run_starts = torch.nonzero(breaks).flatten()
    ends = torch.cat((run_starts[1:], torch.tensor([m], device=device)))
    return run_starts, ends - run_starts


@dataclass
class PseudoBatch:
    """Selected tokens described as contiguous pseudo-requests (one per run).

    ``token_indices``: flat-batch index of each selected token, in query order
    (gather Q by it, scatter the attention output back by it).
    ``query_start_loc`` (int32, ``[num_runs+1]``) and ``seq_lens`` (int32,
    ``[num_runs]``, last position of the run + 1) are the kernel's varlen
    metadata; ``run_request`` (int64) says whose block-table row each run uses.
    """

    token_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    run_request: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_runs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_indices.shape[0]


def pseudo_request_metadata(
    selected_mask: torch.Tensor, segment_ids: torch.Tensor, positions: torch.Tensor
) -> PseudoBatch:
    """Split the selected tokens of a flat batch into per-run pseudo-requests.

    All three are ``[total_tokens]``; tokens of a request must be contiguous
    with strictly increasing ``positions`` (vLLM's batch layout). Syncs once
    to get the run count and maxima.
    """
    n = selected_mask.shape[0]
    if selected_mask.dtype != torch.bool or selected_mask.dim() != 1:
        raise ValueError("selected_mask must be a 1-D bool tensor")
    if segment_ids.shape != (n,) or positions.shape != (n,):
        raise ValueError("segment_ids and positions must be [total_tokens] like selected_mask")
    device = selected_mask.device
    token_indices = torch.nonzero(selected_mask).flatten()
    sel_pos = positions.to(device).long()[token_indices]
    sel_seg = segment_ids.to(device).long()[token_indices]
    starts, lengths = contiguous_runs(sel_pos, sel_seg)

    query_start_loc = torch.zeros(starts.shape[0] + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.cumsum(lengths, 0)
    if starts.shape[0] == 0:
        seq_lens = torch.zeros(0, dtype=torch.int32, device=device)
        run_request = torch.zeros(0, dtype=torch.long, device=device)
        return PseudoBatch(token_indices, query_start_loc, seq_lens, run_request, 0, 0)

    last = starts + lengths - 1
    seq_lens = (sel_pos[last] + 1).to(torch.int32)
    run_request = sel_seg[starts]
    return PseudoBatch(
        token_indices=token_indices,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        run_request=run_request,
        max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()),
    )


def causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None = None,
    q_segment: torch.Tensor | None = None,
    k_segment: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense float32 attention where query i sees key j iff ``k_pos[j] <= q_pos[i]``.

    ``q`` is ``[m, q_heads, d]``, ``k``/``v`` ``[n, kv_heads, d]`` (GQA when
    q_heads is a multiple of kv_heads). Optional segment ids restrict keys to
    the query's own request. A query that sees no key gets zeros. Test oracle
    only: O(m * n) memory.
    """
    m, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"q_heads={hq} must be a multiple of kv_heads={hkv}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)  # [n, hq, d]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), kf) * scale
    visible = k_pos[None, :] <= q_pos[:, None]  # [m, n]
    if q_segment is not None or k_segment is not None:
        if q_segment is None or k_segment is None:
            raise ValueError("pass both q_segment and k_segment or neither")
        visible &= k_segment[None, :] == q_segment[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    out = torch.einsum("hmn,nhd->mhd", probs, vf)
    return out.to(q.dtype)
