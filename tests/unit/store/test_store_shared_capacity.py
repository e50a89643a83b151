"""capacity_gb across processes: four writers on one directory hold the limit together, and
blocks another process keeps reading survive their evictions. Real files and processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from ucm.store import UcmNfsStore
from ucm.store.block_format import HEADER_REGION

from _store_test_helpers import block_for, disk_usage, key_of

PAYLOAD = 60 << 10
FILE = PAYLOAD + HEADER_REGION
WRITERS, PER_WRITER, CAPACITY_BLOCKS = 4, 48, 16
CAPACITY_GB = CAPACITY_BLOCKS * FILE / (1 << 30)


def _writer(root: str, w: int, start, out) -> None:
    store = UcmNfsStore({"storage_backends": root, "capacity_gb": CAPACITY_GB, "io_threads": 1,
                         "usage_rescan_s": 0})
    try:
        store.wait_open_scan()
        start.wait()
        for i in range(PER_WRITER):
            k = key_of(100_000 * (w + 1) + i)
            assert store.wait(store.dump([k], [block_for(k, PAYLOAD)], [1])) == [True]
        out.put(store.stats().evictions)
    finally:
        store.close()


def test_four_writers_hold_the_limit_together(tmp_path):
    """192 distinct blocks into a 16-block store from 4 processes: usage on disk never exceeds the
    limit by more than the blocks in flight (one per writer here), and ends within it."""
    root = str(tmp_path / "store")
    UcmNfsStore({"storage_backends": root}).close()  # the root exists before the writers scan it
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(WRITERS + 1), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(root, w, start, out)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    start.wait()
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, disk_usage(root))
        time.sleep(0.002)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    evictions = sum(out.get(timeout=10) for _ in procs)
    final = disk_usage(root)
    print(f"capacity {CAPACITY_BLOCKS} blocks: peak {peak / FILE:.1f} blocks, final {final / FILE:.1f}, "
          f"evictions {evictions}")
    assert final <= CAPACITY_BLOCKS * FILE
    assert peak <= (CAPACITY_BLOCKS + 2 * WRITERS) * FILE
    assert evictions >= WRITERS * PER_WRITER - CAPACITY_BLOCKS - WRITERS


def _reader(root: str, keys: list[bytes], stop, ready) -> None:
    store = UcmNfsStore({"storage_backends": root})  # default touch interval
    try:
        dests = [np.zeros(PAYLOAD, np.uint8) for _ in keys]
        ready.set()
        while not stop.is_set():
            assert all(store.wait(store.load(keys, dests)))
            time.sleep(0.05)
    finally:
        store.close()


def test_blocks_read_by_another_process_survive_eviction(tmp_path, make_store):
    root = str(tmp_path / "store")
    writer = make_store(storage_backends=root, capacity_gb=CAPACITY_GB)
    keys = [key_of(i) for i in range(CAPACITY_BLOCKS)]
    hot = keys[::2]  # 8 of the 16, interleaved with the cold ones in write order
    assert all(writer.wait(writer.dump(keys, [block_for(k, PAYLOAD) for k in keys], [1] * len(keys))))
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    reader = ctx.Process(target=_reader, args=(root, hot, stop, ready))
    reader.start()
    try:
        assert ready.wait(60)
        time.sleep(1.6)  # past the default touch interval (1 s): the reads refresh the hot mtimes
        new = [key_of(1000 + i) for i in range(8)]
        assert all(writer.wait(writer.dump(new, [block_for(k, PAYLOAD) for k in new], [1] * len(new))))
    finally:
        stop.set()
        reader.join(30)
    assert reader.exitcode == 0
    survived = sum(os.path.exists(writer.block_path(k)) for k in hot)
    print(f"hot blocks read by another process: {survived} of {len(hot)} survived")
    assert survived == len(hot)
    assert not any(os.path.exists(writer.block_path(k)) for k in keys[1::2])
