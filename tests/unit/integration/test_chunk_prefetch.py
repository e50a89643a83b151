"""Chunk blocks read while their blend request waits in the queue (prefetch_chunks), on a real
store directory and the worker half's real paged cache: the scheduler holds the request and names
its blocks; the worker reads them, reports when done, and the request's step takes them instead of
reading again. Reads over the byte limit are left to the step; a read dropped unfinished is kept
until it ends."""

from __future__ import annotations

import time

import pytest
import torch

from fault_mount import FaultMount
from test_scheduler_side import admit, prompt, request, side_for, step, store_chunks
from test_slow_prefix_reads import BS, mounted_worker, prefix_step, stored, worker
from ucm.integration.vllm.connector.chunk_prefetch import ChunkPrefetches
from ucm.integration.vllm.connector.metadata import ChunkPrefetch, UCMConnectorMetadata, UCMWorkerReport


def wait_for(prefetches, req_id, seconds=10.0):
    deadline = time.monotonic() + seconds
    while req_id not in prefetches.poll():
        assert time.monotonic() < deadline, "prefetch never ended"
        time.sleep(0.01)


def test_a_prefetched_step_reads_nothing_again_and_places_the_same_kv(tmp_path):
    w = worker(tmp_path / "store")
    keys = stored(w, 3)
    w.start_load_kv(prefix_step([], keys))  # read in the step
    placed = [c.clone() for c in w.caches]
    reads = w.store.stats().load_blocks
    for c in w.caches:
        c.zero_()
    w.start_load_kv(UCMConnectorMetadata(prefetches=[ChunkPrefetch("b", keys, [BS] * 3)]))
    deadline = time.monotonic() + 10
    while not (w.build_report() or UCMWorkerReport()).prefetched:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert w.store.stats().load_blocks == reads + 3
    w.start_load_kv(prefix_step([], keys))  # request "b"'s step
    assert w.store.stats().load_blocks == reads + 3  # nothing read again
    assert w.stats.data["prefetched_blocks"] == 3
    assert all(torch.equal(a, b) for a, b in zip(w.caches, placed))
    w.store.close()


def test_reads_over_the_limit_are_left_to_the_step_and_end_at_once(tmp_path):
    w = worker(tmp_path / "store")
    keys = stored(w, 2)
    prefetches = ChunkPrefetches(w.store, limit_bytes=BS * w.token_bytes)  # room for one block
    prefetches.start("a", keys, [w.store_key(k) for k in keys], lambda: [w.block_tensor(BS)] * 2,
                     2 * BS * w.token_bytes)
    assert prefetches.poll() == ["a"] and prefetches.take("a") == {}
    prefetches.start("b", keys[:1], [w.store_key(keys[0])], lambda: [w.block_tensor(BS)], BS * w.token_bytes)
    wait_for(prefetches, "b")
    assert list(prefetches.take("b")) == keys[:1] and prefetches.held_bytes == 0
    w.store.close()


@pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")
def test_a_read_dropped_unfinished_keeps_its_buffers_until_it_ends(tmp_path):
    with mounted_worker(tmp_path, 2, latency_ms=300) as (w, keys):
        prefetches = ChunkPrefetches(w.store, limit_bytes=1 << 30)
        prefetches.start("a", keys, [w.store_key(k) for k in keys], lambda: [w.block_tensor(BS) for _ in keys],
                         2 * BS * w.token_bytes)
        prefetches.forget(["a"])  # finished before its step
        assert len(prefetches.draining) == 1 and prefetches.held_bytes == 2 * BS * w.token_bytes
        deadline = time.monotonic() + 20
        while prefetches.draining:
            assert time.monotonic() < deadline
            prefetches.poll()
            time.sleep(0.05)
        assert prefetches.held_bytes == 0


@pytest.mark.parametrize("setting", [True, "auto"])
def test_a_blend_request_waits_for_its_prefetch_then_blends_as_planned(tmp_path, setting):
    side = side_for(tmp_path, ratio=0.5)
    side.reads.prefetch_chunks = setting
    tokens = prompt(1)
    store_chunks(side, tokens)
    if setting == "auto":  # only once the workers said reads are slow
        assert side.get_num_new_matched_tokens(request(side, "x", tokens), 0) == (21, False)
        side.request_finished(request(side, "x", tokens))
        side.take_report(UCMWorkerReport(slow_read_s=0.5))
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # held while its blocks are read
    meta, _ = step(side, [], {})
    (pf,) = meta.prefetches
    assert pf.req_id == "a" and len(pf.keys) == 6 and sum(pf.rows) == 19
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # not read yet: still held
    assert not step(side, [], {})[0].prefetches  # named once
    side.take_report(UCMWorkerReport(prefetched={"a": 1}))
    assert side.get_num_new_matched_tokens(req, 0) == (21, False)
    meta, _ = step(side, [admit(side, req, 21)], {"a": 1})
    (s,) = meta.requests
    assert {ld.key for ld in s.chunk_loads} == set(pf.keys) and s.blend is not None
    assert side.stats.data["chunk_prefetches"] == 1


def test_a_prefetch_not_reported_in_time_lets_the_request_go(tmp_path, monkeypatch):
    from ucm.integration.vllm.connector import read_ahead

    side = side_for(tmp_path)
    side.reads.prefetch_chunks = True
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    monkeypatch.setattr(read_ahead, "PREFETCH_WAIT_S", 0.0)
    assert side.get_num_new_matched_tokens(req, 0) == (21, False)  # its step reads what did not come
