"""Blocks stored as equal segments (format version 2): read whole, or some segments alone, each
verified by its own checksum; a damaged segment fails only the reads that include it."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import torch
import xxhash

from ucm.store import DramStore
from ucm.store.block_format import (HEADER_REGION, MAGIC, PREFIX, SEGMENTED_VERSION, BlockHeader, header_digest,
                                    parse_header, read_header, segments_digest)

from _store_test_helpers import block_for, files_under, key_of

SEGMENTS = 6
SEG = 40_000  # bytes per segment: not a multiple of 4096


def _stored(store, n=3, segments=SEGMENTS):
    keys = [key_of(i) for i in range(n)]
    sources = [block_for(k, SEG * segments) for k in keys]
    assert all(store.wait(store.dump(keys, sources, [7] * n, segments=segments)))
    return keys, sources


def _read(store, keys, first, count, total=SEGMENTS):
    dests = [[np.zeros(SEG, dtype=np.uint8) for _ in range(count)] for _ in keys]
    return store.wait(store.load_segments(keys, dests, first, total)), dests


def test_segments_read_alone_and_whole(make_store):
    store = make_store(io_threads=2)
    keys, sources = _stored(store)
    header = read_header(store.block_path(keys[0]))
    assert header.version == SEGMENTED_VERSION and len(header.segments) == SEGMENTS
    assert header.xxh64 == segments_digest(header.segments)
    for first, count in [(0, 1), (0, 2), (2, 3), (5, 1), (0, SEGMENTS)]:
        ok, dests = _read(store, keys, first, count)
        assert ok == [True] * len(keys)
        for src, parts in zip(sources, dests):
            for j, part in enumerate(parts):
                assert np.array_equal(part, src[(first + j) * SEG:(first + j + 1) * SEG])
    whole = [np.zeros(SEG * SEGMENTS, dtype=np.uint8) for _ in keys]
    assert store.wait(store.load(keys, whole)) == [True] * len(keys)
    assert all(np.array_equal(a, b) for a, b in zip(whole, sources))
    stats = store.stats()
    assert stats.load_errors == 0 and stats.load_bytes == len(keys) * SEG * (1 + 2 + 3 + 1 + SEGMENTS + SEGMENTS)


def test_segments_land_in_parts_of_one_tensor(make_store):
    """The connector reads each layer of a block into that layer's rows of a layer-major buffer."""
    store = make_store()
    keys, sources = _stored(store, n=2)
    staging = torch.zeros((SEGMENTS, 2, SEG), dtype=torch.uint8)
    dests = [[staging[s, b].numpy() for s in range(2, SEGMENTS)] for b in range(2)]
    assert store.wait(store.load_segments(keys, dests, 2, SEGMENTS)) == [True, True]
    for b, src in enumerate(sources):
        for s in range(2, SEGMENTS):
            assert np.array_equal(staging[s, b].numpy(), src[s * SEG:(s + 1) * SEG])
    assert not staging[:2].any()


def test_a_damaged_segment_fails_only_reads_of_it_then_the_block_is_removed(make_store):
    store = make_store()
    keys, _ = _stored(store, n=1)
    path = store.block_path(keys[0])
    with open(path, "r+b") as f:  # one byte of segment 4
        f.seek(4096 + 4 * SEG + 123)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _read(store, keys, 0, 4)[0] == [True]
    assert _read(store, keys, 4, 2)[0] == [False]
    assert files_under(store.config.storage_backends[0], ".kvb") == []  # a corrupt block is removed
    assert store.stats().checksum_errors == 1


def test_a_whole_read_verifies_every_segment(make_store):
    store = make_store()
    keys, _ = _stored(store, n=1)
    with open(store.block_path(keys[0]), "r+b") as f:
        f.seek(4096 + SEGMENTS * SEG - 1)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert store.wait(store.load(keys, [np.zeros(SEG * SEGMENTS, dtype=np.uint8)])) == [False]
    assert store.stats().checksum_errors == 1


def test_segment_reads_of_a_block_stored_whole_fail_and_leave_it(make_store):
    """A version 1 block (one checksum) or one of other segments cannot be read in parts: the
    caller reads it whole; it stays stored."""
    store = make_store()
    keys, _ = _stored(store, n=1, segments=1)
    assert _read(store, keys, 0, 1)[0] == [False]
    other = [key_of(50)]
    assert all(store.wait(store.dump(other, [block_for(other[0], SEG * 6)], [1], segments=3)))
    assert store.wait(store.load_segments(other, [[np.zeros(SEG, dtype=np.uint8)]], 0, 6)) == [False]
    assert store.lookup(keys + other) == [True, True]
    assert store.stats().checksum_errors == 0


def test_caller_errors_name_the_problem(make_store):
    store = make_store()
    key = key_of(1)
    with pytest.raises(ValueError, match="segments=4"):
        store.dump([key], [block_for(key, 1001)], [1], segments=4)
    with pytest.raises(ValueError, match="segments=300"):
        store.dump([key], [block_for(key, 3000)], [1], segments=300)
    keys, _ = _stored(store, n=1)
    with pytest.raises(ValueError, match="segments 5..7 of 6"):
        store.load_segments(keys, [[np.zeros(SEG, dtype=np.uint8)] * 2], 5, SEGMENTS)
    with pytest.raises(ValueError, match="one non-zero size"):
        store.load_segments(keys, [[np.zeros(SEG, dtype=np.uint8), np.zeros(SEG + 1, dtype=np.uint8)]], 0, SEGMENTS)
    with pytest.raises(ValueError, match="1 keys but 2"):
        store.load_segments(keys, [[np.zeros(SEG, dtype=np.uint8)]] * 2, 0, SEGMENTS)


def test_dram_tier_and_dram_store_serve_segments(make_store):
    store = make_store(dram_capacity_gb=0.01)
    keys, sources = _stored(store, n=2)
    ok, dests = _read(store, keys, 1, 2)
    assert ok == [True, True] and store.stats().dram_hits == 2
    assert np.array_equal(dests[1][1], sources[1][2 * SEG:3 * SEG])

    dram = DramStore(10 << 20)
    assert all(dram.wait(dram.dump(keys, sources, [1, 1], segments=SEGMENTS)))
    ok, dests = _read(dram, keys, 3, 3)
    assert ok == [True, True] and np.array_equal(dests[0][2], sources[0][5 * SEG:])
    assert _read(dram, keys, 0, 1, total=7)[0] == [False, False]  # another segment count


def test_engine_reads_a_segmented_block_written_from_python(make_store):
    """The format is the one block_format.py documents: a block written by it loads in parts."""
    store = make_store()
    key = key_of(9)
    payload = block_for(key, SEG * 3).tobytes()
    segments = [xxhash.xxh64(payload[i * SEG:(i + 1) * SEG]).intdigest() for i in range(3)]
    fields = {"version": SEGMENTED_VERSION, "payload_offset": HEADER_REGION, "payload_len": len(payload),
              "token_count": 2, "xxh64": segments_digest(segments), "key": key}
    header = msgpack.packb({**fields, "header_xxh64": header_digest(BlockHeader(**fields)), "segments": segments})
    block = (PREFIX.pack(MAGIC, len(header)) + header).ljust(HEADER_REGION, b"\0") + payload
    path = store.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").write(block)
    assert parse_header(block[:HEADER_REGION]).segments == tuple(segments)
    ok, dests = _read(store, [key], 1, 2, total=3)
    assert ok == [True] and dests[0][1].tobytes() == payload[2 * SEG:]
    bad = block.replace(msgpack.packb(segments), msgpack.packb(segments[::-1]))
    with pytest.raises(ValueError, match="segment list"):
        parse_header(bad[:HEADER_REGION])


def test_a_block_read_whole_in_segments_enters_the_dram_tier(make_store, tmp_path):
    """A worker reads every layer of a block into its staging rows: the DRAM tier keeps the block
    as a whole read would (a part read alone is not kept)."""
    writer = make_store()
    keys, sources = _stored(writer, n=2)
    reader = make_store(dram_capacity_gb=0.01)
    assert _read(reader, keys[:1], 2, 2)[0] == [True]  # a part: not kept
    assert _read(reader, keys, 0, SEGMENTS)[0] == [True, True]
    before = reader.stats().dram_hits
    whole = [np.zeros(SEG * SEGMENTS, dtype=np.uint8) for _ in keys]
    assert reader.wait(reader.load(keys, whole)) == [True, True]
    assert reader.stats().dram_hits == before + 2
    assert all(np.array_equal(a, b) for a, b in zip(whole, sources))
