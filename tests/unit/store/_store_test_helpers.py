"""Deterministic block contents and subprocess workers shared by the store tests.

Lives in a plain module (not a test file) so `spawn` children can import the workers.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import numpy as np
import xxhash

from ucm.store import UcmNfsStore


def key_of(i: int, length: int = 16) -> bytes:
    return xxhash.xxh128(f"key-{i}".encode()).digest()[:length].ljust(length, b"k")


def block_for(key: bytes, size: int) -> np.ndarray:
    """Content derived from the key only, so any process can verify what it loaded."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def size_for(key: bytes, low: int, high: int) -> int:
    return low + int.from_bytes(key[8:12], "little") % (high - low)


def files_under(root: str, suffix: str = "") -> list[str]:
    """Block and temp files of the store's tree (not its root marker or usage ledger)."""
    out = []
    for dirpath, _, names in os.walk(root):
        out.extend(os.path.join(dirpath, n) for n in names if n.endswith(suffix) and n not in (".ucm-store", ".ucm-usage"))
    return out


def disk_usage(root: str) -> int:
    total = 0
    for path in files_under(root):
        try:
            total += os.stat(path).st_size
        except FileNotFoundError:
            pass
    return total


def mixed_worker(root: str, worker: int, pool: int, capacity_gb: float | None, start, seconds: float, out) -> None:
    """After `start` (a barrier), dumps and loads overlapping keys for `seconds`; reports via `out`.

    Every successful load must be bit-exact.
    """
    rng = random.Random(worker)
    store = UcmNfsStore({"storage_backends": root, "io_threads": 2, "capacity_gb": capacity_gb})
    stats = {"loads_ok": 0, "loads_bad": 0, "loads_failed": 0, "dumps_ok": 0, "dumps_failed": 0}
    try:
        start.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            keys = list(dict.fromkeys(key_of(rng.randrange(pool)) for _ in range(4)))
            sizes = [size_for(k, 32 << 10, 256 << 10) for k in keys]
            if rng.random() < 0.5:
                sources = [block_for(k, s) for k, s in zip(keys, sizes)]
                results = store.wait(store.dump(keys, sources, [7] * len(keys)))
                stats["dumps_ok"] += sum(results)
                stats["dumps_failed"] += len(results) - sum(results)
            else:
                dests = [np.zeros(s, dtype=np.uint8) for s in sizes]
                results = store.wait(store.load(keys, dests))
                for k, d, ok in zip(keys, dests, results):
                    if not ok:
                        stats["loads_failed"] += 1
                    elif np.array_equal(d, block_for(k, len(d))):
                        stats["loads_ok"] += 1
                    else:
                        stats["loads_bad"] += 1
        stats["store"] = dataclasses.asdict(store.stats())
    finally:
        store.close()
        out.put(stats)


def salted(base: np.ndarray, key: bytes) -> np.ndarray:
    """A big block for `key` without generating megabytes of randomness per key."""
    out = base.copy()
    out[: len(key)] = np.frombuffer(key, dtype=np.uint8)
    return out


BIG_BASE_KEY = b"big-block-base-0"


def endless_writer(root: str, block_bytes: int, ready) -> None:
    """Dumps big blocks until killed; `ready` is set once the first block is published."""
    store = UcmNfsStore({"storage_backends": root, "io_threads": 2})
    base = block_for(BIG_BASE_KEY, block_bytes)
    i = 0
    while True:
        keys = [key_of(1000 + i), key_of(1001 + i)]
        store.wait(store.dump(keys, [salted(base, k) for k in keys], [1, 1]))
        ready.set()
        i += 2


def unreadable_block_as_nobody(root: str, key: bytes, out) -> None:
    if os.geteuid() == 0:  # root reads any file: check as an unprivileged user
        os.setgid(65534)
        os.setuid(65534)
    store = UcmNfsStore({"storage_backends": root})
    try:
        before = store.lookup([key])
        loaded = store.wait(store.load([key], [np.zeros(1000, np.uint8)]))
        out.put((before, loaded, store.lookup([key]), store.stats().quarantined))
    finally:
        store.close()
