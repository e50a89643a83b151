import math

import pytest
import torch

from ucm.sparse.blend.runs import (
    causal_attention_reference,
    contiguous_runs,
    pseudo_request_metadata,
)


def test_contiguous_runs_single_request():
    starts, lengths = contiguous_runs(torch.tensor([0, 1, 2, 5, 6, 9]))
    assert starts.tolist() == [0, 3, 5]
    assert lengths.tolist() == [3, 2, 1]
    s, l = contiguous_runs(torch.tensor([4]))
    assert s.tolist() == [0] and l.tolist() == [1]
    s, l = contiguous_runs(torch.zeros(0, dtype=torch.long))
    assert s.numel() == 0 and l.numel() == 0


def test_contiguous_runs_break_at_segment_boundary():
    # request 0 ends at position 3, request 1 starts at 4: consecutive but separate.
    pos = torch.tensor([2, 3, 4, 5, 0, 1])
    seg = torch.tensor([0, 0, 1, 1, 2, 2])
    s, l = contiguous_runs(pos, seg)
    assert s.tolist() == [0, 2, 4] and l.tolist() == [2, 2, 2]
    s, l = contiguous_runs(pos)  # without segments only the drop to 0 breaks
    assert s.tolist() == [0, 4] and l.tolist() == [4, 2]


def test_pseudo_request_metadata_hand_example():
    # Two requests of lengths 6 and 4 (positions restart at 0 per request).
    seg = torch.tensor([0] * 6 + [1] * 4)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    sel = torch.tensor([0, 1, 1, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    pb = pseudo_request_metadata(sel, seg, pos)
    assert pb.token_indices.tolist() == [1, 2, 5, 6, 8, 9]
    assert pb.query_start_loc.tolist() == [0, 2, 3, 4, 6]
    assert pb.query_start_loc.dtype == torch.int32
    assert pb.seq_lens.tolist() == [3, 6, 1, 4]
    assert pb.seq_lens.dtype == torch.int32
    assert pb.run_request.tolist() == [0, 0, 1, 1]
    assert pb.run_request.dtype == torch.int64
    assert (pb.max_query_len, pb.max_seq_len, pb.num_runs, pb.num_tokens) == (2, 6, 4, 6)


def test_pseudo_request_metadata_empty_selection():
    pb = pseudo_request_metadata(torch.zeros(5, dtype=torch.bool), torch.zeros(5, dtype=torch.long), torch.arange(5))
    assert pb.num_runs == 0 and pb.num_tokens == 0
    assert pb.query_start_loc.tolist() == [0]
    assert (pb.max_query_len, pb.max_seq_len) == (0, 0)


def bottom_right_run_attention(q, k_req, v_req, scale):
    """What a paged varlen kernel computes for one pseudo-request.

    q: [L, H, d] queries of the run; k_req/v_req: [seq_len, H, d] the request's
    keys at positions 0..seq_len-1. Query i sits at position seq_len - L + i.
    """
    L, s = q.shape[0], k_req.shape[0]
    scores = torch.einsum("lhd,shd->hls", q.float(), k_req.float()) * scale
    q_abs = torch.arange(L) + (s - L)
    mask = torch.arange(s)[None, :] <= q_abs[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v_req.float())


@pytest.mark.parametrize("seed", range(5))
def test_pseudo_requests_equal_reference_attention(seed):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 17, 5, 33, 9]
    H, D = 2, 8
    scale = 1 / math.sqrt(D)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    total = seg.shape[0]
    q = torch.randn(total, H, D, generator=g)
    k = torch.randn(total, H, D, generator=g)
    v = torch.randn(total, H, D, generator=g)
    sel = torch.rand(total, generator=g) < [0.3, 0.5, 0.9][seed % 3]
    sel[seg == 2] = False  # a request with nothing selected
    if seed == 0:
        sel[seg == 3] = True  # a fully selected request -> a single run

    ref = causal_attention_reference(q[sel], k, v, pos[sel], pos, scale, seg[sel], seg)

    pb = pseudo_request_metadata(sel, seg, pos)
    starts = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)[:-1]))
    out = torch.empty(pb.num_tokens, H, D)
    qsel = q[pb.token_indices]
    for r in range(pb.num_runs):
        a, b = pb.query_start_loc[r].item(), pb.query_start_loc[r + 1].item()
        req, s = pb.run_request[r].item(), pb.seq_lens[r].item()
        base = starts[req].item()  # the request's "block table": keys 0..s-1
        out[a:b] = bottom_right_run_attention(qsel[a:b], k[base : base + s], v[base : base + s], scale)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(pb.token_indices, torch.nonzero(sel).flatten())

    # Treating a whole request's scattered selection as one request would be wrong.
    if seed == 1:
        req = 3
        m = sel & (seg == req)
        qs = q[m]
        s = lens[req]
        naive = bottom_right_run_attention(qs, k[seg == req][:s], v[seg == req][:s], scale)
        assert not torch.allclose(naive, ref[(seg[sel] == req)], atol=1e-3)


def test_reference_gqa_and_masking():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(5, 2, 8, generator=g)
    v = torch.randn(5, 2, 8, generator=g)
    kp = torch.arange(5)
    qp = torch.tensor([0, 2, 4])
    out = causal_attention_reference(q, k, v, qp, kp)
    # Query at position 0 sees only key 0: output is exactly v[0] (per kv group).
    assert torch.allclose(out[0], v[0].repeat_interleave(2, dim=0), atol=1e-6)
    # Explicit per-head softmax for the last query, head 3 (kv head 1).
    w = torch.softmax((k[:, 1] @ q[2, 3]) / math.sqrt(8), 0)
    assert torch.allclose(out[2, 3], w @ v[:, 1], atol=1e-5)
    # No visible key -> zeros, not NaN.
    out = causal_attention_reference(q[:1], k, v, torch.tensor([-1]), kp)
    assert torch.equal(out, torch.zeros_like(out))
