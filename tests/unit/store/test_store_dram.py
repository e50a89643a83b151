"""The DRAM tier: byte-bounded LRU, in front of the files when dram_capacity_gb > 0."""

from __future__ import annotations

import shutil

import numpy as np

from ucm.store import DramStore

from _store_test_helpers import block_for, key_of

SIZE = 100_000


def test_dram_store_respects_its_byte_capacity_with_lru_eviction():
    store = DramStore(capacity_bytes=5 * SIZE + 10)
    keys = [key_of(i) for i in range(8)]
    for i, k in enumerate(keys[:5]):
        assert store.wait(store.dump([k], [block_for(k, SIZE)], [i])) == [True]
    dest = np.zeros(SIZE, np.uint8)
    assert store.wait(store.load([keys[0]], [dest])) == [True]  # keys[0] is now most recent
    for k in keys[5:]:
        store.wait(store.dump([k], [block_for(k, SIZE)], [0]))
        assert store.used_bytes <= store.capacity_bytes
    assert store.lookup(keys) == [True, False, False, False, True, True, True, True]
    assert store.stats().evictions == 3
    assert store.wait(store.dump([key_of(99)], [np.zeros(store.capacity_bytes + 1, np.uint8)], [0])) == [False]
    assert np.array_equal(dest, block_for(keys[0], SIZE))


def test_dram_copy_is_independent_of_the_callers_buffer():
    store = DramStore(capacity_bytes=10 * SIZE)
    key = key_of(1)
    src = block_for(key, SIZE)
    store.wait(store.dump([key], [src], [1]))
    src[:] = 0
    dest = np.zeros(SIZE, np.uint8)
    assert store.wait(store.load([key], [dest])) == [True]
    assert np.array_equal(dest, block_for(key, SIZE))


def test_tier_serves_hits_after_the_files_are_gone(tmp_path, make_store):
    root = tmp_path / "store"
    store = make_store(storage_backends=str(root), dram_capacity_gb=4 * SIZE / 2**30)
    keys = [key_of(i) for i in range(6)]
    assert all(store.wait(store.dump(keys, [block_for(k, SIZE) for k in keys], [1] * 6)))
    shutil.rmtree(root)  # the last 4 dumps are still in DRAM
    assert store.lookup(keys) == [False, False, True, True, True, True]
    dests = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert store.wait(store.load(keys, dests)) == [False, False, True, True, True, True]
    assert all(np.array_equal(d, block_for(k, SIZE)) for k, d in zip(keys[2:], dests[2:]))
    stats = store.stats()
    assert (stats.dram_hits, stats.load_blocks, stats.load_errors) == (4, 4, 2)
    assert store._dram.used_bytes <= 4 * SIZE


def test_tier_is_filled_by_file_loads(tmp_path, make_store):
    root = tmp_path / "store"
    writer = make_store(storage_backends=str(root))
    keys = [key_of(i) for i in range(3)]
    assert all(writer.wait(writer.dump(keys, [block_for(k, SIZE) for k in keys], [5] * 3)))
    reader = make_store(storage_backends=str(root), dram_capacity_gb=10 * SIZE / 2**30)
    dests = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert all(reader.wait(reader.load(keys, dests)))
    assert reader.stats().dram_hits == 0
    shutil.rmtree(root)
    dests = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert all(reader.wait(reader.load(keys, dests)))
    assert all(np.array_equal(d, block_for(k, SIZE)) for k, d in zip(keys, dests))
    assert reader.stats().dram_hits == 3
    assert [m.token_count for m in reader.read_meta(keys)] == [5, 5, 5]
