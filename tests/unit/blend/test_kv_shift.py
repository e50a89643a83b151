"""The chunk-mean KV shift (ucm/sparse/blend/kv_shift.py)."""

import pytest
import torch

from ucm.sparse.blend.kv_shift import chunk_mean_errors, kv_shifts, sampled_offsets, shift_sources
from ucm.sparse.blend.rope import Rotation, rotate_keys


def rope_cache(max_pos=512, dim=8, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


@pytest.mark.parametrize("neox", [True, False])
def test_a_common_error_before_rope_is_recovered_and_removed(neox):
    # Every token of chunk 0 is off by the same pre-RoPE K error and V error, chunk 1 by another;
    # chunk 2 has no recomputed token. The mean over the recomputed tokens moves the others onto
    # their fresh KV exactly.
    torch.manual_seed(0)
    cs = rope_cache()
    n, heads, d = 30, 2, 8
    pos = torch.randperm(400)[:n].sort().values
    chunk = torch.tensor([0] * 10 + [1] * 10 + [2] * 10)
    fresh_pre, v_fresh = torch.randn(n, heads, d), torch.randn(n, heads, d)
    err_k, err_v = torch.randn(3, heads, d), torch.randn(3, heads, d)
    fresh = rotate_keys(fresh_pre, pos, cs, neox)
    stored = rotate_keys(fresh_pre - err_k[chunk], pos, cs, neox)
    v_stored = v_fresh - err_v[chunk]
    recomputed = torch.tensor(([True] * 3 + [False] * 7) * 2 + [False] * 10)
    dk, dv, has = chunk_mean_errors(fresh[recomputed], stored[recomputed], v_fresh[recomputed],
                                    v_stored[recomputed], chunk[recomputed], 3, Rotation.of(-pos[recomputed], cs, neox))
    assert has.tolist() == [True, True, False]
    assert torch.allclose(dk[:2], err_k[:2], atol=1e-4) and torch.allclose(dv[:2], err_v[:2], atol=1e-5)
    left = ~recomputed
    add_k, add_v = kv_shifts(chunk[left], dk, dv, has.float(), Rotation.of(pos[left], cs, neox))
    k, v = stored[left] + add_k, v_stored[left] + add_v
    moved = chunk[left] < 2
    assert torch.allclose(k[moved], fresh[left][moved], atol=1e-4)
    assert torch.allclose(v[moved], v_fresh[left][moved], atol=1e-5)
    # Chunk 2 had no estimate: as stored.
    assert torch.equal(k[~moved], stored[left][~moved]) and torch.equal(v[~moved], v_stored[left][~moved])
    # A share moves each chunk by that much of its mean error: half way for chunk 0, not at all for chunk 1.
    add_k, add_v = kv_shifts(chunk[left], dk, dv, has * torch.tensor([0.5, 0.0, 1.0]), Rotation.of(pos[left], cs, neox))
    k, v = stored[left] + add_k, v_stored[left] + add_v
    half = chunk[left] == 0
    assert torch.allclose(k[half], (stored[left][half] + fresh[left][half]) / 2, atol=1e-4)
    assert torch.allclose(v[half], v_fresh[left][half] - err_v[0] / 2, atol=1e-5)
    assert torch.equal(k[~half], stored[left][~half]) and torch.equal(v[~half], v_stored[left][~half])


def test_mismatched_shapes_name_the_problem():
    cs = rope_cache()
    with pytest.raises(ValueError, match="must cover the same tokens"):
        chunk_mean_errors(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8),
                          torch.zeros(2, dtype=torch.long), 1, Rotation.of(torch.zeros(3, dtype=torch.long), cs, True))


def test_a_sample_takes_every_stride_th_token_from_half_a_stride_in():
    offsets = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2])
    assert offsets[sampled_offsets(offsets, 4)].tolist() == [2, 6, 10, 2]
    assert offsets[sampled_offsets(offsets, 1)].tolist() == offsets[offsets >= 0].tolist()  # stride 1: all


def test_a_sampling_requests_chunks_are_estimated_from_their_sample_rows_alone():
    # Rows 0-3: a request estimating from all its recomputed rows (chunk 0). Rows 4-9: a sampling
    # request, chunk 1 with sample rows 5 and 8, chunk 2 (short) with none: its ranked rows stand in.
    # Row 10: not a recomputed loaded row.
    chunk = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, -1])
    sample = torch.tensor([0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    sampling = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    got = shift_sources(chunk, sample, sampling, num_chunks=3)
    assert torch.nonzero(got).flatten().tolist() == [0, 1, 2, 3, 5, 7, 8, 9]


def test_a_sample_recovers_a_chunks_mean_error_where_the_stalest_rows_overshoot_it():
    # The error grows with a token's rank (the ranked rows are the stalest): the ranked rows' mean
    # overshoots the chunk's, an evenly spaced sample's is close to it.
    n, heads, d = 400, 1, 8
    err = torch.linspace(0, 2, n)[:, None, None] * torch.ones(n, heads, d)
    ranked = torch.zeros(n, dtype=torch.bool)
    ranked[-60:] = True  # the 15% with the largest error
    sample = sampled_offsets(torch.arange(n), 33)
    cs = rope_cache(max_pos=n, dim=d)
    for rows, near in ((ranked, False), (sample, True)):
        idx = torch.nonzero(rows).flatten()
        zero = torch.zeros(len(idx), heads, d)
        dk, dv, has = chunk_mean_errors(err[idx], zero, err[idx], zero, torch.zeros(len(idx), dtype=torch.long), 1,
                                        Rotation.of(torch.zeros(len(idx), dtype=torch.long), cs, True))
        assert bool(has[0])
        assert (abs(float(dv.mean()) - float(err.mean())) < 0.05) == near
