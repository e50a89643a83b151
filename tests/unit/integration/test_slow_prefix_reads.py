"""The worker tells the scheduler when reads held a step (async_prefix_loads, prefetch_chunks "auto").

The worker half on a real paged KV cache and a real store on a FUSE mount that adds latency (no
engine): a step whose reads waited over SLOW_READ_S reports how long (chunk reads when they were
slow for their size, as from a slow mount); a fast read reports nothing.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from fault_mount import FaultMount, mounted_or_skip
from ucm.integration.vllm.connector.background_loads import SLOW_READ_S
from ucm.integration.vllm.connector.block_tensors import new_block, stored_bytes
from ucm.integration.vllm.connector.metadata import BlockLoad, RequestStep, UCMConnectorMetadata
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.integration.vllm.kv_layout import layout_for
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key

BS, LAYERS, H, D = 16, 2, 2, 64  # a head size vLLM's CPU attention kernels take


def worker(root) -> WorkerSide:
    store = create_store("UcmNfsStore", {"storage_backends": str(root)})
    store.wait_open_scan()
    w = WorkerSide(SimpleNamespace(cache_config=SimpleNamespace(block_size=BS)), store, check_layer=None)
    w.caches = [torch.zeros(8, H, BS, 2 * D) for _ in range(LAYERS)]
    w.layout = layout_for(w.caches[0], "CPU_ATTN", BS, H, D, isa="vec")
    w._token_shape, w._dtype, w._device = (LAYERS, 2, H, D), torch.float32, torch.device("cpu")
    w.token_bytes = LAYERS * 2 * H * D * 4
    return w


def stored(w: WorkerSide, n: int) -> list:
    keys = [store_key(b"ns", KeyKind.EXACT, bytes([i + 1]) * 32) for i in range(n)]
    blocks = [new_block(BS, (LAYERS, 2, H, D), torch.float32).fill_(i + 1) for i in range(n)]
    assert w.store.wait(w.store.dump([w.store_key(k) for k in keys], [stored_bytes(b) for b in blocks],
                                     [BS] * n, segments=LAYERS)) == [True] * n
    return keys


@contextlib.contextmanager
def mounted_worker(tmp_path, n: int, latency_ms: int):
    """A worker whose store is a FUSE mount holding `n` blocks, then slowed by `latency_ms`:
    yields (worker, keys); the mount is healthy again and the store closed afterwards."""
    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as mount:
        w = worker(mount.mountpoint)
        keys = stored(w, n)
        mount.set(latency_ms=latency_ms)
        try:
            yield w, keys
        finally:  # also when the test fails: the mount answers again before the store's threads stop
            mount.set()
            w.store.close()


def prefix_step(keys, chunk_keys=()) -> UCMConnectorMetadata:
    """Request "a" reads `keys` as its exact prefix; request "b" reads `chunk_keys` as chunk blocks."""
    steps = [RequestStep("a", [1, 2, 3], 0, 4, prefix_loads=[BlockLoad(k, i * BS, BS) for i, k in enumerate(keys)])]
    if chunk_keys:
        steps.append(RequestStep("b", [4, 5, 6], 0, 4,
                                 chunk_loads=[BlockLoad(k, i * BS, BS) for i, k in enumerate(chunk_keys)]))
    return UCMConnectorMetadata(steps)


def test_a_fast_exact_prefix_read_reports_nothing(tmp_path):
    w = worker(tmp_path / "store")
    w.start_load_kv(prefix_step(stored(w, 2)))
    assert w.stats.data.get("failed_blocks", 0) == 0
    assert w.caches[0].abs().sum() > 0  # placed
    assert w.build_report() is None
    w.store.close()


@pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")
def test_a_slow_read_is_reported_whether_exact_prefix_or_chunk_blocks(tmp_path):
    with mounted_worker(tmp_path, 3, latency_ms=int(SLOW_READ_S * 2000)) as (w, keys):
        for step in (prefix_step(keys[:2], chunk_keys=keys[2:]), prefix_step(keys[:2]), prefix_step([], keys)):
            w.start_load_kv(step)
            report = w.build_report()
            assert report is not None and report.slow_read_s > SLOW_READ_S
