"""CacheBlend's gradual filtering: what a later check layer keeps."""

from __future__ import annotations

import torch

from ucm.sparse.blend.gradual import narrowed


def masks(*rows):
    return [torch.tensor(r, dtype=torch.bool) for r in rows]


def test_each_request_keeps_the_best_of_its_loaded_rows_at_the_layers_ratio():
    # Request 0: 10 loaded rows, 4 still recomputed; request 1: 4 loaded rows, 2 recomputed; a question row each.
    segment = torch.tensor([0] * 11 + [1] * 5)
    loaded, = masks([True] * 10 + [False] + [True] * 4 + [False])
    ranked = torch.zeros(16, dtype=torch.bool)
    ranked[[0, 3, 5, 9, 11, 12]] = True
    score = torch.zeros(16)
    score[[0, 3, 5, 9, 11, 12]] = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.2, 0.3])
    keep = narrowed(score, ranked, torch.zeros(16, dtype=torch.bool), loaded, segment, torch.tensor([0.4, 0.5]), 0.2)
    # ceil(0.2 * 10) = 2 of request 0 (rows 3, 9), ceil(0.2 * 4) = 1 of request 1 (row 12)
    assert torch.nonzero(keep).flatten().tolist() == [3, 9, 12]


def test_rows_that_always_stay_count_against_the_share():
    segment = torch.zeros(10, dtype=torch.long)
    loaded = torch.ones(10, dtype=torch.bool)
    ranked, kept = masks([False, True, True, True, False, False, False, False, False, False],
                         [True] + [False] * 9)  # row 0: a chunk start, always recomputed
    score = torch.tensor([0.0, 0.3, 0.2, 0.1] + [0.0] * 6)
    keep = narrowed(score, ranked, kept, loaded, segment, torch.tensor([0.5]), 0.3)
    assert torch.nonzero(keep).flatten().tolist() == [1, 2]  # 3 in all: row 0 and the two best


def test_a_requests_own_lower_ratio_caps_the_layers_and_a_higher_layer_ratio_keeps_everything():
    segment = torch.zeros(10, dtype=torch.long)
    loaded = torch.ones(10, dtype=torch.bool)
    ranked = torch.zeros(10, dtype=torch.bool)
    ranked[:3] = True  # the request selected 3 of 10 at its first check layer (ratio 0.3)
    score = torch.tensor([0.3, 0.2, 0.1] + [0.0] * 7)
    none_kept = torch.zeros(10, dtype=torch.bool)
    assert int(narrowed(score, ranked, none_kept, loaded, segment, torch.tensor([0.3]), 0.5).sum()) == 3
    assert int(narrowed(score, ranked, none_kept, loaded, segment, torch.tensor([0.1]), 0.5).sum()) == 1
    assert int(narrowed(score, ranked, none_kept, loaded, segment, torch.tensor([0.0]), 0.5).sum()) == 0


def test_the_count_survives_float32_rounding():
    """163 of 541 candidates: 163 / 541 in float32 times 541 is just above 163 (ceil: 164)."""
    n = 1081
    segment = torch.zeros(n, dtype=torch.long)
    loaded = torch.ones(n, dtype=torch.bool)
    ranked = torch.zeros(n, dtype=torch.bool)
    ranked[:541] = True
    score = torch.rand(n)
    keep = narrowed(score, ranked, torch.zeros(n, dtype=torch.bool), loaded, segment, torch.tensor([0.5]), 0.15)
    assert int(keep.sum()) == 163  # ceil(0.15 * 1081)
