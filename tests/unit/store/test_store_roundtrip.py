"""Round trips, lookup truth, per-key failures and caller errors of UcmNfsStore."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ucm.store import BlockMeta

from _store_test_helpers import block_for, files_under, key_of, size_for


def test_round_trip_of_many_blocks_in_concurrent_batches(make_store):
    store = make_store(io_threads=3)
    keys = [key_of(i) for i in range(96)]
    sizes = [size_for(k, 1, 300_000) for k in keys]
    sources = [block_for(k, s) for k, s in zip(keys, sizes)]
    dumps = [store.dump(keys[i : i + 8], sources[i : i + 8], list(range(i, i + 8))) for i in range(0, 96, 8)]
    assert all(all(store.wait(t)) for t in dumps)

    dests = [np.zeros(s, dtype=np.uint8) for s in sizes]
    loads = [store.load(keys[i : i + 8], dests[i : i + 8]) for i in range(0, 96, 8)]
    assert all(all(store.wait(t)) for t in loads)
    for src, dest in zip(sources, dests):
        assert np.array_equal(src, dest)

    stats = store.stats()
    assert (stats.dump_blocks, stats.dump_bytes, stats.dump_errors) == (96, sum(sizes), 0)
    assert (stats.load_blocks, stats.load_bytes, stats.load_errors) == (96, sum(sizes), 0)
    assert stats.load_seconds > 0 and stats.dump_seconds > 0
    assert store.read_meta(keys[:2] + [key_of(999)]) == [BlockMeta(sizes[0], 0), BlockMeta(sizes[1], 1), None]


def test_lookup_answers_every_key_past_misses(make_store):
    """203 keys: stats split over the lookup's threads, the last one short."""
    store = make_store()
    stored = [key_of(i) for i in range(0, 203, 3)]
    assert all(store.wait(store.dump(stored, [block_for(k, 100) for k in stored], [1] * len(stored))))
    query = [key_of(i) for i in range(203)]
    assert store.lookup(query) == [i % 3 == 0 for i in range(203)]
    assert store.lookup(query[:5]) == [True, False, False, True, False]
    assert store.lookup([]) == []
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.misses) == (208, 70, 138)


def test_second_dump_of_a_key_is_skipped_and_reported_stored(make_store):
    store = make_store()
    key = key_of(1)
    assert store.wait(store.dump([key], [block_for(key, 1000)], [5])) == [True]
    mtime = os.stat(store.block_path(key)).st_mtime_ns
    assert store.wait(store.dump([key], [block_for(key, 1000)], [5])) == [True]
    assert os.stat(store.block_path(key)).st_mtime_ns == mtime
    stats = store.stats()
    assert (stats.dump_blocks, stats.dump_skipped, stats.dump_bytes) == (2, 1, 1000)


def test_blocks_past_one_read_call_round_trip_into_unaligned_destinations(make_store):
    """A load reads a block's header and payload in calls of up to 8 MiB (store_io.cpp kReadUnit)."""
    store = make_store(io_threads=2)
    sizes = [(8 << 20) - 1, 8 << 20, (8 << 20) + 1, (16 << 20) + 4096 + 7]
    keys = [key_of(1000 + i) for i in range(len(sizes))]
    sources = [block_for(k, s) for k, s in zip(keys, sizes)]
    assert all(store.wait(store.dump(keys, sources, [1] * len(keys))))
    raw = [np.zeros(s + 3, dtype=np.uint8) for s in sizes]
    dests = [r[3:] for r in raw]  # never 4 KiB aligned
    assert all(store.wait(store.load(keys, dests)))
    assert all(np.array_equal(src, dest) for src, dest in zip(sources, dests))


def test_missing_key_and_wrong_destination_length_fail_only_their_key(make_store):
    store = make_store()
    keys = [key_of(i) for i in range(3)]
    assert all(store.wait(store.dump(keys, [block_for(k, 4096) for k in keys], [1, 1, 1])))
    dests = [np.zeros(4096, np.uint8), np.zeros(4095, np.uint8), np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
    assert store.wait(store.load(keys + [key_of(99)], dests)) == [True, False, True, False]
    assert np.array_equal(dests[2], block_for(keys[2], 4096))
    stats = store.stats()
    assert (stats.load_blocks, stats.load_errors, stats.checksum_errors) == (2, 2, 1)
    # Keys name the KV geometry, so a stored length other than the reader's is a damaged header
    # (payload_len): kept, the block would answer every lookup and fail every load.
    assert not os.path.exists(store.block_path(keys[1]))
    assert store.lookup([keys[1]]) == [False]


def test_io_error_is_a_per_key_failure(make_store):
    store = make_store()
    key = key_of(5)
    os.makedirs(store.block_path(key))  # a directory where the block should be: read fails with EISDIR
    ok_key = key_of(6)
    assert store.wait(store.dump([ok_key], [block_for(ok_key, 10)], [1])) == [True]
    dests = [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]
    assert store.wait(store.load([key, ok_key], dests)) == [False, True]
    assert store.stats().load_errors == 1


def test_destinations_of_all_buffer_kinds(make_store):
    store = make_store()
    torch = pytest.importorskip("torch")
    src = np.arange(2 * 3 * 128, dtype=np.float16).reshape(2, 3, 128)
    key = key_of(3)
    assert store.wait(store.dump([key], [src], [128])) == [True]
    nbytes = src.nbytes
    dests = [
        np.zeros_like(src),
        bytearray(nbytes),
        memoryview(bytearray(nbytes)),
        torch.zeros(2, 3, 128, dtype=torch.float16).numpy(),
        np.zeros(nbytes + 1, np.uint8)[1:],  # unaligned start
    ]
    assert store.wait(store.load([key] * len(dests), dests)) == [True] * len(dests)
    for d in dests:
        assert bytes(memoryview(d).cast("B")) == src.tobytes()
    tensor = torch.zeros(2, 3, 128, dtype=torch.float16)
    assert store.wait(store.load([key], [tensor.numpy()])) == [True]
    assert torch.equal(tensor, torch.from_numpy(src))


def test_multiple_backends_spread_keys_by_hash(tmp_path, make_store):
    a, b = tmp_path / "a", tmp_path / "b"
    store = make_store(storage_backends=f"{a}:{b}")
    keys = [key_of(i) for i in range(64)]
    assert all(store.wait(store.dump(keys, [block_for(k, 64) for k in keys], [1] * 64)))
    in_a, in_b = len(files_under(str(a), ".kvb")), len(files_under(str(b), ".kvb"))
    assert in_a + in_b == 64 and in_a > 10 and in_b > 10
    # A second instance listing the same backends finds every block.
    other = make_store(storage_backends=[str(a), str(b)])
    dests = [np.zeros(64, np.uint8) for _ in keys]
    assert all(other.wait(other.load(keys, dests)))


def test_caller_errors_raise_value_error(make_store):
    store = make_store()
    good = key_of(1)
    with pytest.raises(ValueError, match="key 1"):
        store.lookup([good, b"short"])
    with pytest.raises(ValueError, match="key 0"):
        store.lookup(["not bytes" * 4])
    with pytest.raises(ValueError, match="destination 0"):
        store.load([good], [np.zeros((4, 4), np.uint8)[:, ::2]])
    with pytest.raises(ValueError, match="destination 0"):
        store.load([good], [b"read-only bytes"])
    with pytest.raises(ValueError, match="2 keys"):
        store.load([good, good], [bytearray(1)])
    with pytest.raises(ValueError, match="token_counts"):
        store.dump([good], [bytearray(1)], [])
    assert store.stats().load_errors == 0


def test_check_and_wait_are_repeatable_and_closed_store_refuses_work(make_store):
    store = make_store()
    key = key_of(1)
    task = store.dump([key], [block_for(key, 1 << 20)], [1])
    assert store.wait(task) == [True]
    assert store.check(task)
    assert store.wait(task) == [True]
    empty = store.load([], [])
    assert store.wait(empty) == [] and store.check(empty)
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.lookup([key])


def _use_inherited_store(store, out) -> None:
    try:
        store.lookup([key_of(1)])
        out.put("no error")
    except RuntimeError as e:
        out.put(str(e))


def test_a_forked_child_gets_a_clear_error_instead_of_a_hang(make_store):
    import multiprocessing as mp

    store = make_store()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_use_inherited_store, args=(store, out))
    child.start()
    assert "another process" in out.get(timeout=30)
    child.join(30)
    assert store.lookup([key_of(1)]) == [False]
