"""The store on a real disk whose reads the kernel caps (tests/throttled_disk.py): what blend_bench's
--disk measures. Skipped where a loop device or the blkio cgroup is not available (not root)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _store_test_helpers import block_for, key_of
from throttled_disk import ThrottledDisk, throttled_or_skip

pytestmark = pytest.mark.skipif(ThrottledDisk.available() is not None,
                                reason=f"throttled disk: {ThrottledDisk.available()}")


def _blkio_group() -> str:
    return next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":")[1] == "blkio")


def test_blocks_come_from_the_disk_after_an_eviction_and_only_then(make_store):
    segments, seg = 30, 64 << 10
    keys = [key_of(i) for i in range(4)]
    wanted = len(keys) * segments * seg
    with throttled_or_skip(size_gb=1, read_mb_s=500) as disk:
        cgroup = disk._cgroup
        assert _blkio_group() == "/" + cgroup.name
        store = make_store(storage_backends=str(disk.path), io_threads=2)
        assert store.wait(store.dump(keys, [block_for(k, segments * seg) for k in keys], [1] * 4,
                                     segments=segments)) == [True] * 4

        def load_whole() -> int:
            before = disk.read_bytes()
            dest = [np.zeros(segments * seg, dtype=np.uint8) for _ in keys]
            assert store.wait(store.load(keys, dest)) == [True] * 4
            assert all((d == block_for(k, segments * seg)).all() for d, k in zip(dest, keys))
            return disk.read_bytes() - before

        disk.evict()
        assert wanted <= load_whole() < 1.1 * wanted  # each block's header adds a page
        assert load_whole() == 0  # the page cache serves it until the next eviction

        disk.evict()  # layer groups, as a layer-wise load reads them: no byte read twice or ahead
        before = disk.read_bytes()
        for first in range(0, segments, 4):
            count = min(4, segments - first)
            dests = [[np.zeros(seg, dtype=np.uint8) for _ in range(count)] for _ in keys]
            assert store.wait(store.load_segments(keys, dests, first, segments)) == [True] * 4
        assert wanted <= disk.read_bytes() - before < 1.1 * wanted
    assert _blkio_group() == "/" and not cgroup.exists()
