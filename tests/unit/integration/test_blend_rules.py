"""Rules of the Blend forward that need no engine: EPIC's chunk-start rows."""

import torch

from ucm.integration.vllm.blend.forward_batch import chunk_of, near_chunk_start, shift_sample
from ucm.integration.vllm.blend.passes import BlendRows
from ucm.integration.vllm.blend_step import RegionRows
from ucm.sparse.blend.vocabulary import Selection


def region(selection, starts, k, kv_shift=0.0, kv_shift_sample=0.0):
    empty = torch.zeros(0, dtype=torch.long)
    return RegionRows(0, empty, empty, empty, 0.15, selection, 0, torch.tensor(starts), k, kv_shift, kv_shift_sample)


def test_chunk_start_rows_are_the_first_k_of_each_loaded_chunk():
    # Request 0 (EPIC): positions 5..44, chunks loaded from 10 and 30; request 1 (a ranked rule
    # without chunk starts): 0..9; request 2 (a ranked rule with 2 chunk-start tokens): 98..103.
    positions = torch.cat([torch.arange(5, 45), torch.arange(0, 10), torch.arange(98, 104)])
    segment = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(10, dtype=torch.long),
                         torch.full((6,), 2, dtype=torch.long)])
    rows = BlendRows(None, [], None, None, positions, None, segment, None)
    regions = {0: region(Selection.CHUNK_START, [10, 30], 4), 1: region(Selection.HKVD, [0], 0),
               2: region(Selection.QUERY, [100], 2)}
    near = near_chunk_start(regions, rows)
    assert positions[near & (segment == 0)].tolist() == [10, 11, 12, 13, 30, 31, 32, 33]
    assert not near[segment == 1].any()  # a rule with no chunk-start tokens: none
    assert positions[near & (segment == 2)].tolist() == [100, 101]  # rows before the first chunk: none


def test_kv_shift_chunks_are_numbered_across_the_batch():
    # Request 0 shifts (chunks from 10 and 30), request 1 does not, request 2 shifts (chunk from 100).
    positions = torch.cat([torch.arange(5, 45), torch.arange(0, 10), torch.arange(98, 104)])
    segment = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(10, dtype=torch.long),
                         torch.full((6,), 2, dtype=torch.long)])
    rows = BlendRows(None, [], None, None, positions, None, segment, None)
    regions = {0: region(Selection.QUERY, [10, 30], 0, 0.5), 1: region(Selection.QUERY, [0], 0),
               2: region(Selection.HKVD, [100], 0, 1.0)}
    chunk, shares = chunk_of(regions, rows)
    assert shares.tolist() == [0.5, 0.5, 1.0]  # each chunk's request's share
    assert chunk[:40].tolist() == [-1] * 5 + [0] * 20 + [1] * 15  # before the first chunk: none
    assert (chunk[40:50] == -1).all()
    assert chunk[50:].tolist() == [-1, -1, 2, 2, 2, 2]


def test_shift_sample_rows_are_evenly_spaced_within_each_loaded_chunk():
    # Request 0 samples a quarter of each chunk (stride 4; chunks from 10 and 30), request 1 shifts
    # without a sample, request 2 samples but does not shift (nothing to estimate).
    positions = torch.cat([torch.arange(5, 45), torch.arange(0, 10), torch.arange(98, 104)])
    segment = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(10, dtype=torch.long),
                         torch.full((6,), 2, dtype=torch.long)])
    rows = BlendRows(None, [], None, None, positions, None, segment, None)
    regions = {0: region(Selection.QUERY, [10, 30], 0, 1.0, 0.25), 1: region(Selection.QUERY, [0], 0, 0.5),
               2: region(Selection.HKVD, [100], 0, 0.0, 0.25)}
    sample, sampling = shift_sample(regions, rows)
    assert positions[sample].tolist() == [12, 16, 20, 24, 28, 32, 36, 40, 44]  # from each chunk's start
    assert sampling.tolist() == [True] * 40 + [False] * 16
