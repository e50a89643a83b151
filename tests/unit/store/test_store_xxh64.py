"""The native XXH64 (vendored xxHash, csrc/third_party) must equal the Python xxhash package's bit
for bit, through the extension's buffer handling (any contiguous buffer, unaligned starts)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from ucm.store import _native

SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 1000, 4095, 4096, 4097,
         (1 << 20) + 3, (3 << 20) + 13, 8 << 20]
SEEDS = [0, 1, 0x9E3779B97F4A7C15, 2**64 - 1]


def test_matches_python_xxhash_for_many_sizes_and_seeds():
    data = os.urandom(max(SIZES) + 64)
    for size in SIZES:
        for offset in (0, 1, 7):  # unaligned starts exercise the unaligned loads
            chunk = memoryview(data)[offset : offset + size]
            for seed in SEEDS:
                assert _native.xxh64(chunk, seed) == xxhash.xxh64(chunk, seed=seed).intdigest(), (size, offset, seed)


def test_accepts_any_contiguous_buffer_and_hashes_its_bytes():
    arr = np.arange(12345, dtype=np.float32).reshape(5, 2469)
    expected = xxhash.xxh64(arr.tobytes()).intdigest()
    assert _native.xxh64(arr) == expected
    assert _native.xxh64(bytearray(arr.tobytes())) == expected
    assert _native.xxh64(memoryview(arr)) == expected


def test_rejects_non_contiguous_buffer():
    arr = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises((BufferError, ValueError)):
        _native.xxh64(arr)
