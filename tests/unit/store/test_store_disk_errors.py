"""Full and read-only filesystems: dumps fail cleanly and visibly, loads keep working."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from ucm.store import UcmNfsStore

from _store_test_helpers import block_for, files_under, key_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs, unmounted after the test."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _remount(mnt, mode: str) -> None:
    proc = subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot remount {mode}: {proc.stderr.strip()}")


SIZE = 256 << 10


def test_full_disk_fails_dumps_cleanly_and_loads_keep_working(small_tmpfs, caplog):
    store = UcmNfsStore({"storage_backends": str(small_tmpfs / "store"), "io_threads": 2})
    try:
        keys = [key_of(i) for i in range(16)]  # 4 MiB into 2 MiB
        sources = [block_for(k, SIZE) for k in keys]
        results = []
        for i in range(0, 16, 4):
            results += store.wait(store.dump(keys[i : i + 4], sources[i : i + 4], [1] * 4))
        stored = [k for k, ok in zip(keys, results) if ok]
        assert 1 <= len(stored) < 16
        stats = store.stats()
        assert stats.dump_errors == 16 - len(stored)
        assert stats.dump_blocks == len(stored)
        assert not files_under(str(small_tmpfs), ".tmp"), "failed writes leave no partial files"
        assert "No space left on device" in caplog.text
        assert store.lookup(keys) == results

        dests = [np.zeros(SIZE, np.uint8) for _ in stored]
        assert all(store.wait(store.load(stored, dests)))
        assert all(np.array_equal(d, block_for(k, SIZE)) for k, d in zip(stored, dests))
    finally:
        store.close()


def test_read_only_filesystem_fails_dumps_and_serves_loads(small_tmpfs):
    root = str(small_tmpfs / "store")
    store = UcmNfsStore({"storage_backends": root, "touch_interval_s": 0})
    try:
        keys = [key_of(i) for i in range(4)]
        assert all(store.wait(store.dump(keys[:2], [block_for(k, 1000) for k in keys[:2]], [1, 1])))
        _remount(small_tmpfs, "ro")
        assert store.wait(store.dump(keys[2:], [block_for(k, 1000) for k in keys[2:]], [1, 1])) == [False, False]
        assert store.stats().dump_errors == 2
        dests = [np.zeros(1000, np.uint8) for _ in range(2)]
        assert store.wait(store.load(keys[:2], dests)) == [True, True]  # the mtime touch fails silently
        assert store.lookup(keys) == [True, True, False, False]
    finally:
        store.close()
        _remount(small_tmpfs, "rw")

    _remount(small_tmpfs, "ro")
    with pytest.raises(ValueError, match=root):
        UcmNfsStore({"storage_backends": root})
    _remount(small_tmpfs, "rw")
