"""Exact-prefix reads between steps (vLLM's asynchronous load path) on a real store directory:
finished reads are placed and their request listed as received; a corrupt block, a store that
raises and a read hung past the deadline are failures reported with their block ids, never
placed. The hung read runs on a FUSE mount that stops answering (skipped where FUSE cannot mount)."""

from __future__ import annotations

import time

import pytest
import torch

from fault_mount import FaultMount, mounted_or_skip
from ucm.integration.vllm.connector.background_loads import BackgroundLoads
from ucm.integration.vllm.connector.block_tensors import new_block, stored_bytes
from ucm.integration.vllm.faults import FAULTS_ENV
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key

SHAPE = (4, 2, 2, 2, 8)  # [block tokens, layers, K/V, heads, head size]


def open_store(root, **config):
    store = create_store("UcmNfsStore", {"storage_backends": str(root), **config})
    store.wait_open_scan()
    return store


def stored_blocks(store, n):
    """n blocks of distinct contents, dumped: (keys, contents)."""
    keys = [store_key(b"ns", KeyKind.EXACT, bytes([i + 1]) * 32) for i in range(n)]
    blocks = [new_block(SHAPE[0], SHAPE[1:], torch.float32).fill_(i + 1) for i in range(n)]
    assert store.wait(store.dump(keys, [stored_bytes(b) for b in blocks], [SHAPE[0]] * n, segments=SHAPE[1])) \
        == [True] * n
    return keys, blocks


def start(loads, req_id, keys, block_ids):
    loads.start(req_id, keys, [new_block(SHAPE[0], SHAPE[1:], torch.float32).zero_() for _ in keys],
                [torch.arange(i * 4, i * 4 + 4) for i in block_ids], block_ids)


def poll_until_received(loads, placed, seconds=10.0):
    deadline = time.monotonic() + seconds
    while True:
        got = loads.poll(lambda buf, slots: placed.append((buf.clone(), slots)))
        if got.req_ids or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_a_finished_read_is_placed_and_its_request_received(tmp_path):
    store = open_store(tmp_path / "store")
    keys, blocks = stored_blocks(store, 3)
    loads = BackgroundLoads(store)
    start(loads, "a", keys, [7, 8, 9])
    placed = []
    got = poll_until_received(loads, placed)
    assert got.req_ids == {"a"} and not got.failed_block_ids and got.loaded_blocks == 3
    assert [torch.equal(buf, b) for (buf, _), b in zip(placed, blocks)] == [True] * 3
    assert [int(slots[0]) for _, slots in placed] == [28, 32, 36]
    assert len(loads) == 0 and not loads.poll(placed.append).req_ids  # received once
    store.close()


def test_a_corrupt_block_fails_alone_and_is_never_placed(tmp_path):
    store = open_store(tmp_path / "store")
    keys, blocks = stored_blocks(store, 2)
    path = store.block_path(keys[1])
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    loads = BackgroundLoads(store)
    start(loads, "a", keys, [3, 4])
    placed = []
    got = poll_until_received(loads, placed)
    assert got.req_ids == {"a"} and got.failed_block_ids == {4} and got.failed_req_ids == {"a"}
    assert len(placed) == 1 and torch.equal(placed[0][0], blocks[0])
    store.close()


def test_a_store_that_raises_fails_every_block_at_the_next_poll(tmp_path, monkeypatch):
    faults = tmp_path / "faults"
    faults.write_text("load")
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    store = open_store(tmp_path / "store")
    keys, _ = stored_blocks(store, 2)
    loads = BackgroundLoads(store)
    start(loads, "a", keys, [1, 2])
    got = loads.poll(lambda *_: pytest.fail("nothing may be placed"))
    assert got.req_ids == {"a"} and got.failed_block_ids == {1, 2}
    store.close()


def test_a_placement_that_raises_counts_as_a_failed_block(tmp_path):
    store = open_store(tmp_path / "store")
    keys, _ = stored_blocks(store, 1)
    loads = BackgroundLoads(store)
    start(loads, "a", keys, [5])

    def broken(buf, slots):
        raise RuntimeError("no room")

    deadline = time.monotonic() + 10
    while not (got := loads.poll(broken)).req_ids:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert got.failed_block_ids == {5} and got.loaded_blocks == 0
    store.close()


@pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")
def test_a_read_hung_past_the_deadline_fails_and_others_are_not_held(tmp_path):
    """Reads hung on the mount: polls return at once with nothing while the deadline runs (the
    other requests' steps go on), then the request is received with every block failed; a read
    started after release completes."""
    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as mount:
        store = open_store(mount.mountpoint, load_timeout_s=1.5, lookup_timeout_s=1, down_backoff_s=0.2,
                           down_backoff_max_s=0.5)
        keys, blocks = stored_blocks(store, 2)
        mount.set(hang=["open", "read"])
        loads = BackgroundLoads(store)
        start(loads, "a", keys, [1, 2])
        t0 = time.monotonic()
        polls = 0
        while not (got := loads.poll(lambda *_: pytest.fail("a hung read may not be placed"))).req_ids:
            polls += 1
            time.sleep(0.05)
        assert 1.4 < time.monotonic() - t0 < 5 and polls > 10
        assert got.failed_block_ids == {1, 2}
        mount.set()
        time.sleep(1.0)  # the hung reads return; the store's back-off ends
        start(loads, "b", keys, [1, 2])
        placed = []
        got = poll_until_received(loads, placed)
        assert got.req_ids == {"b"} and got.loaded_blocks == 2 and torch.equal(placed[1][0], blocks[1])
        store.close()
