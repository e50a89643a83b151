"""A writer killed mid-dump never exposes a partial block, and its temp files are cleaned up."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np

from ucm.store import UcmNfsStore
from ucm.store.block_format import HEADER_REGION, parse_header
from ucm.store.housekeeping import is_stale_temp
from ucm.store.layout import TempOwner, parse_temp_owner

from _store_test_helpers import BIG_BASE_KEY, block_for, endless_writer, files_under, salted

BLOCK = 24 << 20  # big enough that the writer spends most of its time mid-write


def _kill_writer(root: str) -> None:
    """Start a writer, let it publish a block, then SIGKILL it (mid-write if a temp file shows up)."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=endless_writer, args=(root, BLOCK, ready), daemon=True)
    proc.start()
    assert ready.wait(60), "writer never published a block"
    deadline = time.monotonic() + 3
    while not files_under(root, ".tmp") and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()  # reap it: a zombie's pid still counts as alive


def _assert_visible_blocks_are_whole(root: str) -> None:
    """Reads the files directly, without a store, so nothing is cleaned up or removed."""
    base = block_for(BIG_BASE_KEY, BLOCK)
    blocks = files_under(root, ".kvb")
    assert blocks
    for path in blocks:
        key = bytes.fromhex(os.path.basename(path)[: -len(".kvb")])
        with open(path, "rb") as f:
            header = parse_header(f.read(HEADER_REGION))
            payload = f.read()
        assert header.key == key and header.payload_len == BLOCK == len(payload), path
        assert payload == salted(base, key).tobytes(), path


def test_killed_writer_leaves_no_visible_partial_block(tmp_path):
    root = str(tmp_path / "store")
    for _ in range(10):  # until the kill lands while a temp file exists
        _kill_writer(root)
        _assert_visible_blocks_are_whole(root)
        if files_under(root, ".tmp"):
            break
    leftovers = files_under(root, ".tmp")
    assert leftovers, "could not kill the writer while it had a temp file"
    assert all(os.path.getsize(p) <= BLOCK + HEADER_REGION for p in leftovers)

    store = UcmNfsStore({"storage_backends": root, "io_threads": 2})
    try:
        assert store.wait_open_scan(30)
        assert not files_under(root, ".tmp"), "the next store removes a dead local writer's temp files"
        base = block_for(BIG_BASE_KEY, BLOCK)
        for path in files_under(root, ".kvb"):
            key = bytes.fromhex(os.path.basename(path)[: -len(".kvb")])
            dest = np.zeros(BLOCK, np.uint8)
            assert store.wait(store.load([key], [dest])) == [True]
            assert np.array_equal(dest, salted(base, key))
        assert store.stats().checksum_errors == 0
    finally:
        store.close()


def _touch_temp(root: str, name: str, age_s: float) -> str:
    path = os.path.join(root, "ab", "cd", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"partial")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_open_scan_removes_only_abandoned_temp_files(tmp_path):
    root = str(tmp_path / "store")
    probe = UcmNfsStore({"storage_backends": root})
    host = probe._layout.host
    probe.close()
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    hexkey = "abcd" + "0" * 28
    paths = {
        "other host, old": _touch_temp(root, f".{hexkey}~elsewhere~123~aaaa0001.tmp", 3600),
        "other host, fresh": _touch_temp(root, f".{hexkey}~elsewhere~123~aaaa0002.tmp", 5),
        "this host, dead pid": _touch_temp(root, f".{hexkey}~{host}~{dead.pid}~aaaa0003.tmp", 5),
        "this host, live pid": _touch_temp(root, f".{hexkey}~{host}~{os.getpid()}~aaaa0004.tmp", 5),
        "not ours": _touch_temp(root, "someone-elses.tmp", 3600),
    }
    store = UcmNfsStore({"storage_backends": root, "temp_grace_s": 600})
    try:
        assert store.wait_open_scan(30)
        survivors = {name for name, p in paths.items() if os.path.exists(p)}
        assert survivors == {"other host, fresh", "this host, live pid", "not ours"}
    finally:
        store.close()


def test_temp_name_round_trip_and_staleness_rule():
    assert parse_temp_owner(".00ff~host-1.example~4242~0badf00d.tmp") == TempOwner("host-1.example", 4242)
    assert parse_temp_owner("00ff.kvb") is None
    assert parse_temp_owner(".00ff~host~notapid~x.tmp") is None
    now = time.time()
    assert is_stale_temp(TempOwner("h", os.getpid()), now - 700, now, "h", 600)
    assert not is_stale_temp(TempOwner("h", os.getpid()), now - 10, now, "h", 600)
    assert not is_stale_temp(TempOwner("other", 1), now - 10, now, "h", 600)
