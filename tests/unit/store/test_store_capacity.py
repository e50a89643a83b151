"""capacity_gb holds under sustained dumps, evicts least recently used blocks, across processes."""

from __future__ import annotations

import os
import time

import numpy as np

from ucm.store.block_format import HEADER_REGION

from _store_test_helpers import block_for, disk_usage, key_of

PAYLOAD = 60 << 10
FILE = PAYLOAD + HEADER_REGION  # 64 KiB on disk
CAPACITY = 16 * FILE + FILE // 2  # room for 16.5 blocks
CAPACITY_GB = CAPACITY / (1 << 30)


def _dump(store, keys):
    return store.wait(store.dump(keys, [block_for(k, PAYLOAD) for k in keys], [1] * len(keys)))


def _load(store, keys):
    dests = [np.zeros(PAYLOAD, np.uint8) for _ in keys]
    ok = store.wait(store.load(keys, dests))
    return ok, dests


def test_usage_stays_within_capacity_and_recently_used_blocks_survive(tmp_path, make_store):
    root = str(tmp_path / "store")
    store = make_store(storage_backends=root, capacity_gb=CAPACITY_GB, io_threads=3)
    hot = [key_of(i) for i in range(3)]
    assert all(_dump(store, hot))
    written = 0
    for batch in range(100):  # 300 blocks = ~19 MiB through a ~1 MiB store
        keys = [key_of(1000 + 3 * batch + j) for j in range(3)]
        assert all(_dump(store, keys))
        written += len(keys) * FILE
        assert disk_usage(root) <= CAPACITY + FILE
        ok, _ = _load(store, hot)  # keeps them most recently used
        assert all(ok)
    assert written > 15 * CAPACITY
    ok, dests = _load(store, hot + keys)
    assert all(ok)
    assert all(np.array_equal(d, block_for(k, PAYLOAD)) for k, d in zip(hot + keys, dests))
    stats = store.stats()
    assert stats.evictions >= 300 - 17
    assert store.used_bytes <= CAPACITY


def test_a_read_by_another_process_protects_a_block_from_eviction(tmp_path, make_store):
    """Recency is shared through mtimes: the evicting store sees that someone else read a block."""
    root = str(tmp_path / "store")
    writer = make_store(storage_backends=root, capacity_gb=CAPACITY_GB)
    reader = make_store(storage_backends=root, touch_interval_s=0)
    keys = [key_of(i) for i in range(16)]
    assert all(_dump(writer, keys))
    time.sleep(0.05)  # file mtimes come from the kernel's coarse clock
    ok, _ = _load(reader, [keys[0]])
    assert ok == [True]
    assert all(_dump(writer, [key_of(100 + i) for i in range(4)]))
    assert os.path.exists(writer.block_path(keys[0]))
    assert not os.path.exists(writer.block_path(keys[1]))


def test_stores_converge_on_the_real_usage_by_scanning(tmp_path, make_store):
    root = str(tmp_path / "store")
    first = make_store(storage_backends=root, capacity_gb=CAPACITY_GB, usage_rescan_s=0)
    assert all(_dump(first, [key_of(i) for i in range(8)]))
    # A store opened later starts from a scan of what is there.
    second = make_store(storage_backends=root, capacity_gb=CAPACITY_GB, usage_rescan_s=0)
    assert second.used_bytes == disk_usage(root) == 8 * FILE
    assert all(_dump(second, [key_of(100 + i) for i in range(16)]))  # evicts the first store's blocks
    assert disk_usage(root) <= CAPACITY + FILE
    # Usage is shared through the ledger: the first store sees the second one's writes at once.
    # It learns of the files themselves (its eviction candidates) by rescanning.
    assert first.used_bytes == disk_usage(root)
    first.rescan()
    assert first.used_bytes == disk_usage(root)
    for i in range(8):
        assert all(_dump(first, [key_of(200 + i)]))
        assert disk_usage(root) <= CAPACITY + FILE


def test_background_rescan_picks_up_other_writers(tmp_path, make_store):
    root = str(tmp_path / "store")
    watcher = make_store(storage_backends=root, capacity_gb=CAPACITY_GB, usage_rescan_s=0.05)
    writer = make_store(storage_backends=root)
    assert all(_dump(writer, [key_of(i) for i in range(5)]))
    deadline = time.monotonic() + 10
    while watcher.used_bytes != 5 * FILE and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watcher.used_bytes == 5 * FILE


def test_a_dump_larger_than_the_capacity_is_cut_to_fit(make_store):
    """One batch of more blocks than the store holds: the first that fit are stored, the rest are
    refused (False, counted), and the limit holds."""
    from ucm.store.block_format import file_size

    size = 60 << 10
    store = make_store(capacity_gb=4 * file_size(size) / (1 << 30))
    keys = [key_of(900 + i) for i in range(10)]
    ok = store.wait(store.dump(keys, [block_for(k, size) for k in keys], [1] * 10))
    assert ok == [True] * 4 + [False] * 6
    assert store.stats().dump_over_capacity == 6 and store.used_bytes <= 4 * file_size(size)
    more = [key_of(950 + i) for i in range(2)]
    assert store.wait(store.dump(more, [block_for(k, size) for k in more], [1] * 2)) == [True, True]
    assert store.stats().evictions == 2
