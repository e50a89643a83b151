"""io_direct: aligned and unaligned buffers round-trip; refused O_DIRECT falls back to buffered IO."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from ucm.store import _native
from ucm.store.block_format import HEADER_REGION, read_header

from _store_test_helpers import block_for, key_of

# Past one read call's 8 MiB (store_io.cpp kReadUnit) with and without an unaligned tail, too.
SIZES = [1, 4096, 5000, (256 << 10) + 4096, (1 << 20) + 17, 8 << 20, (8 << 20) + 4096 * 3 + 5]


def _aligned(size: int, offset: int) -> np.ndarray:
    raw = np.zeros(size + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    return raw[start : start + size]


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_direct_io_round_trip(tmp_path, make_store, where, caplog):
    root = str(tmp_path / "store") if where == "tmp_path" else f"/dev/shm/ucm-direct-{os.getpid()}"
    if where != "tmp_path" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    fallbacks_before = _native.direct_io_fallbacks()
    try:
        store = make_store(storage_backends=root, io_direct=True, io_threads=2)
        keys = [key_of(i) for i in range(len(SIZES))]
        for offset in (0, 1):
            sources = [_aligned(s, offset) for s in SIZES]
            for k, src in zip(keys, sources):
                src[:] = block_for(k, len(src))
            ks = [k + bytes([offset]) for k in keys]
            assert all(store.wait(store.dump(ks, sources, [1] * len(ks))))
            for k, src in zip(ks, sources):
                path = store.block_path(k)
                assert os.path.getsize(path) == HEADER_REGION + len(src)
                assert read_header(path).xxh64 == xxhash.xxh64(src.tobytes()).intdigest()
            dests = [_aligned(s, offset) for s in SIZES]
            assert all(store.wait(store.load(ks, dests)))
            assert all(np.array_equal(s, d) for s, d in zip(sources, dests))
        if _native.direct_io_fallbacks() > fallbacks_before:
            assert "O_DIRECT refused" in caplog.text
    finally:
        if where != "tmp_path":
            import shutil

            shutil.rmtree(root, ignore_errors=True)
