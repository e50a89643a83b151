import math

import pytest
import torch

from ucm.sparse.blend.runs import causal_attention_reference
from ucm.sparse.blend.tiled_attention import TilePlan, tiled_causal_attention


def head_major(k, v):
    return k.permute(1, 2, 0).contiguous(), v.transpose(0, 1).contiguous()


@pytest.mark.parametrize("q_heads,kv_heads,tile", [(9, 3, 4), (4, 4, 1), (6, 2, 32), (8, 2, 5)])
def test_matches_dense_causal_reference(q_heads, kv_heads, tile):
    g = torch.Generator().manual_seed(q_heads * 7 + tile)
    d, num_keys = 16, 300
    # Scattered positions with runs, gaps and the very first and last key.
    q_pos = torch.tensor([0, 1, 2, 9, 40, 41, 100, 101, 102, 103, 150, 230, 231, 299])
    q = torch.randn(q_pos.shape[0], q_heads, d, generator=g)
    k = torch.randn(num_keys, kv_heads, d, generator=g)
    v = torch.randn(num_keys, kv_heads, d, generator=g)
    scale = 1 / math.sqrt(d)
    plan = TilePlan.build(q_pos, q_heads // kv_heads, tile)
    got = tiled_causal_attention(q, *head_major(k, v), plan, scale)
    want = causal_attention_reference(q, k, v, q_pos, torch.arange(num_keys), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_keys_after_a_query_do_not_change_it():
    g = torch.Generator().manual_seed(0)
    q_pos = torch.tensor([3, 4, 20])
    q = torch.randn(3, 2, 8, generator=g)
    k = torch.randn(32, 1, 8, generator=g)
    v = torch.randn(32, 1, 8, generator=g)
    plan = TilePlan.build(q_pos, 2, tile=3)
    before = tiled_causal_attention(q, *head_major(k, v), plan, 0.3)
    k[5:], v[5:] = 100.0, -100.0  # after the first two queries, before the third
    after = tiled_causal_attention(q, *head_major(k, v), plan, 0.3)
    torch.testing.assert_close(after[:2], before[:2])
    assert not torch.allclose(after[2], before[2])


def test_longer_key_buffer_and_bfloat16_inputs():
    g = torch.Generator().manual_seed(1)
    q_pos = torch.tensor([10, 11, 50])
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(64, 2, 8, generator=g)  # pages hold keys past the last query
    v = torch.randn(64, 2, 8, generator=g)
    want = causal_attention_reference(q, k, v, q_pos, torch.arange(64), 0.5)
    plan = TilePlan.build(q_pos, 2)
    got = tiled_causal_attention(q.bfloat16(), *head_major(k.bfloat16(), v.bfloat16()), plan, 0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="sorted"):
        TilePlan.build(torch.tensor([5, 3]), 1)
    with pytest.raises(ValueError, match="1-D"):
        TilePlan.build(torch.zeros(2, 2), 1)
    plan = TilePlan.build(torch.tensor([1, 7]), group=2)
    with pytest.raises(ValueError, match="does not match"):
        tiled_causal_attention(torch.randn(2, 3, 4), torch.randn(1, 4, 8), torch.randn(1, 8, 4), plan, 1.0)
    with pytest.raises(ValueError, match="keys needed"):
        tiled_causal_attention(torch.randn(2, 2, 4), torch.randn(1, 4, 5), torch.randn(1, 5, 4), plan, 1.0)


def test_plan_masks_only_the_tail_of_each_tile():
    plan = TilePlan.build(torch.tensor([0, 5, 6, 6, 9]), group=1, tile=2)
    assert [(t.start, t.end, t.lo, t.hi) for t in plan.tiles] == [(0, 2, 0, 6), (2, 4, 6, 7), (4, 5, 9, 10)]
    assert plan.tiles[0].tail_hidden.tolist() == [[False, True, True, True, True, True], [False] * 6]
    assert plan.tiles[1].tail_hidden is None and plan.tiles[2].tail_hidden is None
