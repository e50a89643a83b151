import math

import pytest
import torch

from ucm.sparse.blend.query_probe import (
    attention_mass,
    concentrated_mass,
    oracle_layer_score,
    probe_candidates,
    probe_query_mask,
    rows_after_loaded,
    query_weighted_score,
    scored_layers,
)


def dense_mass(q, k, q_pos, scale):
    """Reference: per-head softmax over visible keys, summed over heads and queries."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), kk) * scale
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return probs.sum(dim=(0, 1))


@pytest.mark.parametrize("q_heads,kv_heads,chunk", [(4, 4, 32), (9, 3, 2), (6, 2, 5)])
def test_attention_mass_matches_dense_reference(q_heads, kv_heads, chunk):
    g = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    d, num_keys = 16, 40
    q = torch.randn(7, q_heads, d, generator=g)
    k = torch.randn(num_keys, kv_heads, d, generator=g)
    q_pos = torch.tensor([5, 17, 18, 30, 37, 38, 39])
    scale = 1 / math.sqrt(d)
    got = attention_mass(q, k, q_pos, scale, query_chunk=chunk)
    torch.testing.assert_close(got, dense_mass(q, k, q_pos, scale), rtol=1e-5, atol=1e-5)
    # Each (query, head) distributes exactly one unit of probability.
    assert got.sum().item() == pytest.approx(7 * q_heads, rel=1e-5)
    # Causal: nothing lands after the last query's position.
    assert got[40:].numel() == 0 and got[:40].min() >= 0


def test_attention_mass_weighted_by_values_matches_dense_reference():
    g = torch.Generator().manual_seed(7)
    d, num_keys = 16, 30
    q = torch.randn(5, 6, d, generator=g)
    k = torch.randn(num_keys, 2, d, generator=g)
    v = torch.randn(num_keys, 2, d, generator=g)
    q_pos = torch.tensor([9, 20, 27, 28, 29])
    scale = 1 / math.sqrt(d)
    got = attention_mass(q, k, q_pos, scale, query_chunk=2, v=v)
    kk = k.repeat_interleave(3, dim=1)
    probs = (torch.einsum("mhd,nhd->hmn", q, kk) * scale).masked_fill(
        ~(torch.arange(num_keys)[None, :] <= q_pos[:, None])[None], float("-inf")).softmax(-1)
    v_norm = v.norm(dim=-1).repeat_interleave(3, dim=1).T  # [q_heads, keys]
    torch.testing.assert_close(got, (probs * v_norm[:, None, :]).sum(dim=(0, 1)), rtol=1e-5, atol=1e-5)


def test_a_key_without_value_gets_no_weighted_mass():
    """A token the heads look at but whose V is zero adds nothing to their output: it ranks last."""
    q = torch.randn(3, 2, 8)
    k = torch.randn(6, 1, 8)
    k[2] = q[:, 0].mean(0, keepdim=True) * 10  # the heads look at key 2 most ...
    v = torch.randn(6, 1, 8)
    v[2] = 0  # ... and it carries nothing
    plain = attention_mass(q, k, torch.tensor([5, 5, 5]), 1.0)
    weighted = attention_mass(q, k, torch.tensor([5, 5, 5]), 1.0, v=v)
    assert int(plain.argmax()) == 2 and weighted[2] == 0 and weighted.min() == 0


def test_attention_mass_rejects_values_of_other_keys():
    with pytest.raises(ValueError, match="v"):
        attention_mass(torch.randn(2, 2, 8), torch.randn(5, 1, 8), torch.tensor([1, 2]), 1.0,
                       v=torch.randn(4, 1, 8))


def test_scored_layers_are_the_second_half_after_the_check_layer():
    assert scored_layers(28, 1) == range(14, 28)  # Qwen2.5-1.5B
    assert scored_layers(30, 1) == range(15, 30)  # SmolLM2-135M
    assert scored_layers(24, 20) == range(21, 24)  # a deep check layer: the layers after it
    assert scored_layers(2, 1) == range(2, 2)  # nothing after the last layer


def test_attention_mass_is_causal_per_query():
    d = 8
    q = torch.randn(1, 2, d)
    k = torch.randn(10, 1, d)
    got = attention_mass(q, k, torch.tensor([3]), 1.0)
    assert torch.all(got[4:] == 0)
    assert got[:4].sum().item() == pytest.approx(2.0, rel=1e-5)


def test_attention_mass_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_mass(torch.randn(2, 3, 8), torch.randn(5, 2, 8), torch.tensor([1, 2]), 1.0)
    with pytest.raises(ValueError, match="needs keys up to it"):
        attention_mass(torch.randn(2, 2, 8), torch.randn(5, 1, 8), torch.tensor([1, 5]), 1.0)
    with pytest.raises(ValueError, match="q_pos"):
        attention_mass(torch.randn(2, 2, 8), torch.randn(5, 1, 8), torch.tensor([1]), 1.0)


def test_probe_query_mask_picks_rows_after_last_loaded_row():
    # request 0: loaded, loaded, miss, loaded, q, q, q | request 1: no loaded rows | request 2: ends loaded
    loaded = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    seg = torch.tensor([0] * 7 + [1] * 2 + [2] * 2)
    got = probe_query_mask(loaded, seg, 3)
    assert got.nonzero().flatten().tolist() == [4, 5, 6]
    five_loaded = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    capped = probe_query_mask(five_loaded, torch.zeros(8, dtype=torch.long), 1, max_queries=2)
    assert capped.nonzero().flatten().tolist() == [6, 7]  # the last rows, next to the answer


def test_probe_query_mask_reads_the_last_eligible_rows():
    # loaded x 8, question x 4, then 3 generated tokens (a request prefilled again after a preemption)
    loaded = torch.tensor([1] * 8 + [0] * 7, dtype=torch.bool)
    prompt_rows = torch.tensor([True] * 12 + [False] * 3)
    got = probe_query_mask(loaded, torch.zeros(15, dtype=torch.long), 1, max_queries=2, eligible=prompt_rows)
    assert got.nonzero().flatten().tolist() == [10, 11]  # the question's last rows, as at its first blend


def test_probe_query_mask_skips_requests_whose_uncached_rows_outnumber_the_loaded():
    # request 0: 2 loaded rows then 5 new rows; request 1: 5 loaded rows then 5 new rows.
    loaded = torch.tensor([1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    seg = torch.tensor([0] * 7 + [1] * 10)
    got = probe_query_mask(loaded, seg, 2, max_queries=3)
    assert got.nonzero().flatten().tolist() == [14, 15, 16]  # request 0: 5 new rows > max(3, 2 loaded)
    assert probe_query_mask(loaded, seg, 2, max_queries=5)[2:7].all()  # 5 <= max(5, 2): probed


def test_rows_after_loaded_are_the_whole_question_not_only_the_probed_rows():
    # request 0: loaded x 5, miss, loaded, q x 5 | request 1: no loaded row | request 2: ends loaded
    loaded = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    seg = torch.tensor([0] * 12 + [1] * 2 + [2] * 2)
    assert rows_after_loaded(loaded, seg, 3).nonzero().flatten().tolist() == [7, 8, 9, 10, 11]
    probed = probe_query_mask(loaded, seg, 3, max_queries=2)
    assert probed.nonzero().flatten().tolist() == [10, 11]  # a subset of the question


def test_probe_query_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="bool"):
        probe_query_mask(torch.tensor([1, 0]), torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="max_queries"):
        probe_query_mask(torch.tensor([True, False]), torch.tensor([0, 0]), 1, max_queries=0)


def test_probe_candidates_widen_the_ratio_per_request_and_skip_unprobed_rows():
    # request 0: 6 loaded rows + 1 question row, probed, ratio 0.25 -> 2 * 0.25 * 6 = 3 candidates
    # request 1: 4 loaded rows, not probed -> none; request 2: 2 loaded rows, ratio 0.75 -> all (capped)
    seg = torch.tensor([0] * 7 + [1] * 4 + [2] * 3)
    loaded = torch.tensor([True] * 6 + [False] + [True] * 4 + [True, True, False])
    probed = torch.tensor([True] * 7 + [False] * 4 + [True] * 3)
    mass = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.05, 0.7, 5.0, 9.0, 9.0, 9.0, 9.0, 0.2, 0.1, 7.0])
    ratios = torch.tensor([0.25, 0.5, 0.75])
    got = probe_candidates(mass, loaded, probed, seg, ratios, factor=2.0, num_segments=3)
    assert got.nonzero().flatten().tolist() == [1, 3, 5, 11, 12]
    with pytest.raises(ValueError, match="factor"):
        probe_candidates(mass, loaded, probed, seg, ratios, factor=0.5)


def test_query_weighted_score_ranks_candidates_only_and_falls_back_to_deviation_where_not_probed():
    mass = torch.tensor([0.5, 2.0, 3.0, 0.0, 0.0])
    dev = torch.tensor([4.0, 0.0, 1.0, 3.0, 5.0])  # squared L2
    probed = torch.tensor([True, True, True, False, False])
    candidates = torch.tensor([True, True, False, False, False])
    # candidates: their attention; other probed rows below every candidate; else deviation
    assert query_weighted_score(mass, dev, probed, candidates).tolist() == [0.5, 2.0, -1.0, 3.0, 5.0]


def test_query_weighted_score_ranks_by_attention_whatever_the_deviation():
    """A token the question reads more outranks one whose KV changed more at the check layer: the
    deviation there does not weigh a probed request's ranking (a zero deviation included)."""
    mass = torch.tensor([2.0, 1.0, 0.5])
    dev = torch.tensor([0.0, 9.0, 100.0])
    every = torch.ones(3, dtype=torch.bool)
    score = query_weighted_score(mass, dev, every, every)
    assert score.argsort(descending=True).tolist() == [0, 1, 2]


def test_oracle_layer_score_is_attention_times_v_error_norm():
    mass = torch.tensor([0.5, 2.0, 0.0])
    stale = torch.zeros(3, 2, 2)
    fresh = stale.clone()
    fresh[0, 0] = torch.tensor([3.0, 4.0])  # error norm 5
    fresh[1, 1, 0] = -1.0  # norm 1
    fresh[2] = 7.0  # large error, but the question does not read the token
    assert oracle_layer_score(mass, fresh, stale).tolist() == [2.5, 2.0, 0.0]
    with pytest.raises(ValueError, match="same tokens"):
        oracle_layer_score(mass[:2], fresh, stale)


def test_concentrated_mass_sums_squared_shares_per_request_and_layer():
    per_layer = torch.tensor([[1.0, 1.0, 2.0, 10.0, 30.0],   # request 0 (rows 0-2) spreads; request 1 concentrates
                              [3.0, 0.0, 1.0, 0.0, 0.0]])
    segment = torch.tensor([0, 0, 0, 1, 1])
    got = concentrated_mass(per_layer, segment, 2)
    want = torch.tensor([0.25 ** 2 + 0.75 ** 2, 0.25 ** 2, 0.5 ** 2 + 0.25 ** 2, 0.25 ** 2, 0.75 ** 2])
    assert torch.allclose(got, want)


def test_concentrated_mass_ranks_by_the_layer_that_retrieves_not_by_the_largest_mass():
    """Layer 0 spreads a large mass (large V norms) over every token; layer 1 puts most of a small
    mass on token 2. Summing masses ranks token 0 first; the squared shares rank token 2."""
    per_layer = torch.tensor([[40.0, 35.0, 30.0, 35.0], [0.1, 0.1, 2.0, 0.1]])
    segment = torch.zeros(4, dtype=torch.long)
    assert int(per_layer.sum(0).argmax()) == 0
    assert int(concentrated_mass(per_layer, segment, 1).argmax()) == 2


def test_concentrated_mass_of_a_request_without_mass_is_zero_and_no_layers_give_zeros():
    got = concentrated_mass(torch.zeros(2, 3), torch.tensor([0, 0, 1]), 2)
    assert torch.equal(got, torch.zeros(3))
    assert torch.equal(concentrated_mass(torch.zeros(0, 3), torch.tensor([0, 0, 1]), 2), torch.zeros(3))
    with pytest.raises(ValueError, match="layers, n"):
        concentrated_mass(torch.zeros(3), torch.tensor([0, 0, 1]), 2)
