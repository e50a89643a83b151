"""Chunk blocks read while their blend request waits in the queue (`prefetch_chunks`).

A blend request's chunk blocks feed its step's forward, so they are read inside that step, and
on a slow mount the read holds every request of the batch. With prefetching the scheduler holds
the request in the queue for a step or more and names its chunk blocks in the step's metadata;
each worker reads them into buffers of its own while the other requests' steps run and reports
when its reads ended (well or not). The request's Blend step then copies the blocks read well
into place and reads only the rest, as without prefetching. Buffers are never reused while the
store may still write them: a prefetch dropped unfinished (its request finished or was planned
again) waits in `draining` until its read ends or passes the store's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ucm.integration.vllm.connector.background_loads import give_up_time, outcome_if_ended
from ucm.integration.vllm.connector.block_tensors import layer_parts, stored_bytes
from ucm.integration.vllm.connector.metadata import BlockLoad, ChunkPrefetch
from ucm.store.base import KVStoreBase, Task
from ucm.store.keys import StoreKey


@dataclass
class _Prefetch:
    task: Task | None  # None: refused before any IO (every block is read in the step)
    keys: list[StoreKey]  # as the scheduler names them
    buffers: list[torch.Tensor]
    nbytes: int
    give_up_at: float | None
    ok: list[bool] | None = None  # set once the read ended

    def ended(self, store: KVStoreBase, now: float) -> bool:
        if self.ok is None and self.task is not None:
            self.ok = outcome_if_ended(store, self.task, self.give_up_at, now)
        return self.task is None or self.ok is not None


# Buffers of chunk blocks read for queued blend requests, at most, per worker.
PREFETCH_LIMIT_BYTES = 2 << 30


class ChunkPrefetches:
    """One worker's chunk reads for queued blend requests, bounded by `limit_bytes` of buffers."""

    def __init__(self, store: KVStoreBase, limit_bytes: int = PREFETCH_LIMIT_BYTES):
        self.store = store
        self.limit_bytes = limit_bytes
        self._reads: dict[str, _Prefetch] = {}
        self._reported: set[str] = set()
        self.draining: list[_Prefetch] = []

    @property
    def held_bytes(self) -> int:
        return sum(p.nbytes for p in (*self._reads.values(), *self.draining))

    def start(self, req_id: str, keys: Sequence[StoreKey], store_keys: Sequence[bytes],
              buffers: Callable[[], list[torch.Tensor]], nbytes: int) -> None:
        """Starts reading `store_keys` (this rank's names of `keys`) into `buffers()`; over the
        byte limit, or when the store raises, nothing is read (the step reads them, as before)."""
        self.forget([req_id])
        task, bufs = None, []
        if self.held_bytes + nbytes <= self.limit_bytes:
            bufs = buffers()
            try:
                task = self.store.load(list(store_keys), [stored_bytes(b) for b in bufs])
            except Exception:  # a cache fault must not take the engine down: read in the step
                task, bufs = None, []
        self._reads[req_id] = _Prefetch(task, list(keys), bufs, nbytes if task else 0, give_up_time(self.store, task))
        self._reported.discard(req_id)

    def poll(self) -> list[str]:
        """Requests whose reads ended since the last poll (each listed once)."""
        now = time.monotonic()
        self.draining = [p for p in self.draining if not p.ended(self.store, now)]
        ended = [r for r, p in self._reads.items() if r not in self._reported and p.ended(self.store, now)]
        self._reported.update(ended)
        return ended

    def start_all(self, prefetches: Sequence[ChunkPrefetch], shard_key: Callable[[StoreKey], bytes],
                  block: Callable[[int], torch.Tensor], token_bytes: int) -> None:
        """Starts a step's prefetches (`shard_key`: this rank's name of a block; `block(rows)`: a buffer)."""
        for pf in prefetches:
            self.start(pf.req_id, pf.keys, [shard_key(k) for k in pf.keys],
                       lambda rows=pf.rows: [block(n) for n in rows], sum(pf.rows) * token_bytes)

    def fill(self, loads: Sequence[tuple[str, BlockLoad]], destinations: Sequence[torch.Tensor]) -> set[int]:
        """Copies the blocks read well ahead of the step into the destinations of those (request
        id, chunk load) pairs; returns their indices (the others are read in the step)."""
        got: dict[StoreKey, torch.Tensor] = {}
        for req_id in {req_id for req_id, _ in loads}:
            got.update(self.take(req_id))
        filled = set()
        for i, (_, ld) in enumerate(loads):
            buf = got.get(ld.key)
            if buf is not None and buf.shape == destinations[i].shape:
                destinations[i].copy_(buf)
                filled.add(i)
        return filled

    def take(self, req_id: str) -> dict[StoreKey, torch.Tensor]:
        """The request's blocks read well, by key; an unfinished read is waited for up to its deadline."""
        p = self._reads.pop(req_id, None)
        self._reported.discard(req_id)
        if p is None or p.task is None:
            return {}
        if p.ok is None:
            remaining = None if p.give_up_at is None else max(1e-3, p.give_up_at - time.monotonic())
            p.ok = self.store.wait(p.task, timeout_s=remaining)
        return {k: b for k, b, good in zip(p.keys, p.buffers, p.ok) if good}

    def forget(self, req_ids) -> None:
        """Drops the reads of requests that finished or will not use them."""
        for req_id in req_ids:
            p = self._reads.pop(req_id, None)
            self._reported.discard(req_id)
            if p is not None and not p.ended(self.store, time.monotonic()):
                self.draining.append(p)


def read_others(store: KVStoreBase, keys: Sequence[bytes], destinations: Sequence[torch.Tensor],
                filled: set[int], after_submit: Callable[[], None] = lambda: None) -> tuple[Task, list[bool], int]:
    """Reads the blocks not filled from a prefetch: (the store's task, every block's outcome, bytes read).
    Each block's layers land apart (its rows in layer-major staging buffers)."""
    read = [i for i in range(len(keys)) if i not in filled]
    layers = destinations[0].shape[1] if destinations else 1
    task = store.load_segments([keys[i] for i in read], [layer_parts(destinations[i]) for i in read], 0, layers)
    after_submit()  # reads that may wait behind these
    ok = [True] * len(keys)
    for i, good in zip(read, store.wait(task)):
        ok[i] = good
    return task, ok, sum(destinations[i].numel() * destinations[i].element_size() for i in read)
