"""LayerwiseLoad on a real store: layer groups read in order and placed when a layer asks for
them; a block failing only in a later group fails the forward, one failing in the first group is
left out; a forward that stops early costs at most one deadline."""

from __future__ import annotations

import os

import pytest
import torch

from ucm.integration.vllm.connector.block_tensors import new_block, stored_bytes
from ucm.integration.vllm.connector.layerwise_loads import LayerLoadFailed, LayerwiseLoad, layer_groups, read_step
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key

L, T, H, D = 6, 4, 2, 8


def test_layer_groups():
    assert layer_groups(30, 1) == [(0, 2), (2, 6), (6, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 30)]
    assert layer_groups(6, 1, per_group=3) == [(0, 2), (2, 5), (5, 6)]
    assert layer_groups(30, 29) == [(0, 30)]


@pytest.fixture
def stored(tmp_path):
    store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path)})
    store.wait_open_scan()
    keys = [store_key(b"ns", KeyKind.EXACT, bytes([i + 1]) * 32) for i in range(3)]
    blocks = [new_block(T, (L, 2, H, D), torch.float32).copy_(torch.randn(T, L, 2, H, D)) for _ in keys]
    assert store.wait(store.dump(keys, [stored_bytes(b) for b in blocks], [T] * 3, segments=L)) == [True] * 3
    yield store, keys, blocks
    store.close()


def _load(store, keys):
    dests = [new_block(T, (L, 2, H, D), torch.float32).zero_() for _ in keys]
    placed = []
    lw = LayerwiseLoad(store, keys, dests, layer_groups(L, 1, per_group=2), UCMConnectorStats())
    lw.place = lambda a, b: placed.append((a, b))
    return lw, dests, placed


def test_groups_are_placed_in_order_as_layers_ask(stored):
    store, keys, blocks = stored
    lw, dests, placed = _load(store, keys)
    lw.start_later()
    assert lw.first_group() == [True] * 3
    assert all(torch.equal(d[:, :2], b[:, :2]) for d, b in zip(dests, blocks))
    lw.ready(1)
    assert placed == []  # the first group is the caller's
    lw.ready(3)
    assert placed == [(2, 4)]
    lw.ready(3)
    lw.ready(5)
    assert placed == [(2, 4), (4, 6)]
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert lw.finish()
    assert lw.stats.data["layerwise_wait_seconds"] > 0


def test_a_step_reads_its_blend_chunk_blocks_layer_wise_the_others_whole(stored):
    """Of the step's blocks, the first `layered` (Blend chunk blocks) not filled by a prefetch are
    read layer-wise: their first group before read_step returns, the rest when the forward asks."""
    store, keys, blocks = stored
    dests = [new_block(T, (L, 2, H, D), torch.float32).zero_() for _ in keys]
    stats = UCMConnectorStats()
    # Block 0 came from a prefetch, block 1 is a Blend chunk block, block 2 another (a prefix) block.
    task, ok, read_bytes, lw = read_step(store, keys, dests, {0}, 2, L, 1, stats)
    assert ok == [True] * 3 and read_bytes == dests[2].numel() * 4
    assert stats.data["layerwise_blocks"] == 1
    assert torch.equal(dests[2], blocks[2]) and not dests[0].any()
    assert torch.equal(dests[1][:, :2], blocks[1][:, :2])  # the first group, through the check layer
    lw.ready(L - 1)
    assert torch.equal(dests[1], blocks[1]) and lw.finish()
    assert read_step(store, keys, dests, set(), 0, L, 1, stats)[3] is None  # nothing layer-wise


def test_a_block_failing_later_fails_the_forward_one_failing_first_is_left_out(stored):
    store, keys, _ = stored
    missing = store_key(b"ns", KeyKind.EXACT, b"\xee" * 32)
    lw, _, placed = _load(store, keys + [missing])
    assert lw.first_group() == [True, True, True, False]  # the missing block is left out: no error for it
    os.unlink(store.block_path(keys[1]))  # gone after its first group was read
    lw.start_later()
    with pytest.raises(LayerLoadFailed, match="1 chunk block"):
        lw.ready(5)
    assert placed == []
    assert lw.finish()  # nothing given up: the buffers may be reused


def test_finish_waits_for_reads_a_forward_left(stored):
    store, keys, blocks = stored
    lw, dests, placed = _load(store, keys)
    lw.first_group()
    lw.start_later()
    assert lw.finish() and placed == []
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))  # read, never placed


def test_a_hung_mount_costs_one_deadline_not_one_per_group(tmp_path):
    """Reads hang after the first group: the later groups' reads are ended within about one load
    deadline however many there are, and their buffers reported busy (never reused)."""
    import time

    from fault_mount import mounted_or_skip

    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as mount:
        store = create_store("UcmNfsStore", {"storage_backends": str(mount.mountpoint), "load_timeout_s": 1.0,
                                             "down_backoff_s": 0.1})
        store.wait_open_scan()
        try:
            keys = [store_key(b"ns", KeyKind.EXACT, bytes([i + 1]) * 32) for i in range(2)]
            blocks = [new_block(T, (L, 2, H, D), torch.float32).fill_(i) for i in range(2)]
            assert store.wait(store.dump(keys, [stored_bytes(b) for b in blocks], [T] * 2, segments=L)) == [True] * 2
            dests = [new_block(T, (L, 2, H, D), torch.float32) for _ in keys]
            lw = LayerwiseLoad(store, keys, dests, layer_groups(L, 0, per_group=1), UCMConnectorStats())
            assert lw.first_group() == [True, True]
            mount.set(hang=["read", "open"])
            lw.start_later()  # 5 groups of one layer each
            start = time.monotonic()
            assert not lw.finish()
            assert time.monotonic() - start < 4.0  # one deadline (~1 s), not five
        finally:
            mount.set()
            store.close()
