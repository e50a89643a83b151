import math

import pytest
import torch

from ucm.sparse.blend.hkvd import (
    compute_mask,
    hkvd_candidates,
    num_to_select,
    select_hkvd,
    token_deviation,
)


def brute_force(dev, cand, seg, ratio):
    """Per-token Python reference: sort each segment's candidates by (-dev, index)."""
    out = [False] * len(dev)
    for s in sorted(set(seg)):
        idx = [i for i in range(len(dev)) if seg[i] == s and cand[i]]
        r = ratio[s] if isinstance(ratio, list) else ratio
        k = num_to_select(r, len(idx))
        for i in sorted(idx, key=lambda i: (-dev[i], i))[:k]:
            out[i] = True
    return out


def test_token_deviation():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3, 8, generator=g)
    b = torch.randn(7, 3, 8, generator=g)
    want = torch.tensor([sum(float(torch.dot(a[i, h] - b[i, h], a[i, h] - b[i, h])) for h in range(3)) for i in range(7)])
    got = token_deviation(a.to(torch.bfloat16), b.to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (7,)
    assert torch.allclose(token_deviation(a, b), want, rtol=1e-5)
    assert torch.allclose(got, want, rtol=5e-2)
    assert torch.equal(token_deviation(a, a), torch.zeros(7))
    with pytest.raises(ValueError):
        token_deviation(a, b[:6])


@pytest.mark.parametrize(
    "ratio, n, k",
    [(0.0, 10, 0), (1.0, 10, 10), (0.15, 100, 15), (0.15, 10, 2), (0.01, 3, 1), (0.5, 0, 0), (0.3, 10, 3), (1e-9, 5, 0)],
)
def test_num_to_select(ratio, n, k):
    assert num_to_select(ratio, n) == k


@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError):
        num_to_select(ratio, 3)
    with pytest.raises(ValueError):
        select_hkvd(torch.ones(3), torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long), ratio)


def test_hand_example_ties_lower_position_first():
    dev = torch.tensor([5.0, 9.0, 5.0, 5.0, 1.0, 7.0, 7.0, 3.0])
    cand = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    seg = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    # seg 0: 4 candidates, ratio .5 -> 2: index 1 (9.0), then index 0 (first of the 5.0 ties)
    # seg 1: 3 candidates -> ceil(1.5) = 2: indices 5, 6
    got = select_hkvd(dev, cand, seg, 0.5)
    assert got.tolist() == [True, True, False, False, False, True, True, False]


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.15, 0.37, 0.5, 1.0])
def test_random_against_brute_force(ratio):
    g = torch.Generator().manual_seed(int(ratio * 100))
    sizes = [0, 13, 1, 40, 7, 25]  # includes an empty segment id (0)
    seg = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    n = seg.shape[0]
    dev = torch.randint(0, 6, (n,), generator=g).float()  # many ties
    cand = torch.rand(n, generator=g) < 0.7
    cand[seg == 4] = False  # a segment with no candidates
    got = select_hkvd(dev, cand, seg, ratio)
    assert got.tolist() == brute_force(dev.tolist(), cand.tolist(), seg.tolist(), ratio)
    assert not (got & ~cand).any()
    if ratio == 1.0:
        assert torch.equal(got, cand)
    if ratio == 0.0:
        assert not got.any()


def test_per_request_ratio_and_num_segments():
    g = torch.Generator().manual_seed(5)
    seg = torch.tensor([0] * 10 + [1] * 10 + [2] * 10)
    dev = torch.rand(30, generator=g)
    cand = torch.ones(30, dtype=torch.bool)
    ratios = [0.0, 0.3, 1.0]
    got = select_hkvd(dev, cand, seg, torch.tensor(ratios), num_segments=3)
    assert got.tolist() == brute_force(dev.tolist(), cand.tolist(), seg.tolist(), ratios)
    assert got.view(3, 10).sum(1).tolist() == [0, 3, 10]
    with pytest.raises(ValueError):
        select_hkvd(dev, cand, seg, torch.tensor([0.1, 0.2]))


def test_all_reduce_makes_ranks_agree():
    g = torch.Generator().manual_seed(6)
    seg = torch.tensor([0] * 20 + [1] * 12)
    cand = torch.rand(32, generator=g) < 0.8
    part = [torch.rand(32, generator=g) for _ in range(2)]  # per-rank head shards
    total = part[0] + part[1]
    want = select_hkvd(total, cand, seg, 0.25)
    for rank in range(2):
        other = part[1 - rank]
        # returning style (vLLM's tensor_model_parallel_all_reduce)
        got = select_hkvd(part[rank].clone(), cand, seg, 0.25, all_reduce=lambda t: t + other)
        assert torch.equal(got, want)
        # in-place style (torch.distributed.all_reduce returns None)
        def inplace(t, other=other):
            t.add_(other)

        got = select_hkvd(part[rank].clone(), cand, seg, 0.25, all_reduce=inplace)
        assert torch.equal(got, want)
    # Sanity: without the reduce, ranks would disagree on this data.
    assert not torch.equal(select_hkvd(part[0], cand, seg, 0.25), want)


def test_nan_ranks_highest_and_empty():
    dev = torch.tensor([1.0, float("nan"), 3.0, 2.0])
    cand = torch.ones(4, dtype=torch.bool)
    assert select_hkvd(dev, cand, torch.zeros(4, dtype=torch.long), 0.25).tolist() == [False, True, False, False]
    e = select_hkvd(torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long), 0.5)
    assert e.shape == (0,) and e.dtype == torch.bool
    none = select_hkvd(torch.rand(5), torch.zeros(5, dtype=torch.bool), torch.zeros(5, dtype=torch.long), 1.0)
    assert not none.any()


def test_masks():
    # tokens:        chunk-hit x3 | chunk-miss | suffix x2 | non-blending request x2
    cache_hit = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    suffix = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    blending = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    cand = hkvd_candidates(cache_hit, suffix, blending)
    assert cand.tolist() == [True, True, True, False, False, False, False, False]
    hkvd = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    got = compute_mask(hkvd, cache_hit, suffix, blending)
    assert got.tolist() == [False, True, False, True, True, True, True, True]
    # A suffix token marked as loaded is still computed.
    hit_suffix = cache_hit.clone()
    hit_suffix[4] = True
    assert compute_mask(hkvd, hit_suffix, suffix, blending)[4]
    assert not hkvd_candidates(hit_suffix, suffix, blending)[4]
    with pytest.raises(ValueError):
        compute_mask(hkvd[:3], cache_hit, suffix, blending)


def test_key_deviation_l1_and_l2_rank_differently():
    """UCM's rule (L1) and LMCache's (L2) on the same K error: one large error in a single head
    dimension against small errors spread over all of them."""
    from ucm.sparse.blend.hkvd import token_deviation_l1

    loaded = torch.zeros(2, 2, 4)
    fresh = loaded.clone()
    fresh[0, 0, 0] = 2.0  # concentrated: L1 2, L2 4
    fresh[1] += 0.4  # spread over 8 values: L1 3.2, L2 1.28
    l1, l2 = token_deviation_l1(fresh, loaded), token_deviation(fresh, loaded)
    torch.testing.assert_close(l1, torch.tensor([2.0, 3.2]))
    torch.testing.assert_close(l2, torch.tensor([4.0, 1.28]))
    assert int(l1.argmax()) == 1 and int(l2.argmax()) == 0
    with pytest.raises(ValueError, match="num_heads"):
        token_deviation_l1(fresh[0], loaded[0, 0])
