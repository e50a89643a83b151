"""A worker's dumps: a step's blocks gathered from vLLM's paged cache and handed to the store,
their buffers and bytes until the store has written them, and what it answered, for the
scheduler's report.

Dumps are asynchronous (the store's IO threads write them while the next steps run), so their
gathered buffers must live until the store is done, and under cold traffic the queue must be
bounded: beyond `limit_bytes` a step's dumps are dropped (counted) rather than queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ucm.integration.vllm.connector.block_tensors import stored_bytes
from ucm.integration.vllm.connector.metadata import BlockDump, RequestStep, UCMWorkerReport
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.faults import inject
from ucm.store.base import KVStoreBase, Task
from ucm.store.keys import StoreKey

logger = logging.getLogger(__name__)


@dataclass
class PendingDump:
    task: Task
    keys: list[StoreKey]  # the blocks' keys as the scheduler knows them (this rank's shard is stored)
    buffers: list[torch.Tensor] = field(default_factory=list)  # kept alive until the store is done
    nbytes: int = 0


class DumpQueue:
    def __init__(self, store: KVStoreBase, limit_bytes: int):
        self.store = store
        self.limit_bytes = limit_bytes
        self.pending: list[PendingDump] = []
        self.pending_bytes = 0
        self._failure_logged = False

    def __bool__(self) -> bool:
        return bool(self.pending)

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more may be queued (an empty queue always takes one step's dumps)."""
        return not self.pending or self.pending_bytes + nbytes <= self.limit_bytes

    def add(self, dump: PendingDump) -> None:
        self.pending.append(dump)
        self.pending_bytes += dump.nbytes

    def submit(self, dumps: list[tuple[RequestStep, BlockDump]], gather: Callable[[RequestStep, BlockDump], torch.Tensor],
               shard: Callable[[StoreKey], StoreKey], token_bytes: int, report: UCMWorkerReport,
               stats: UCMConnectorStats) -> None:
        """Gathers a step's trusted dumps and hands them to the store's IO threads (`shard`: this
        rank's key of a block); refused without IO while the store counts as down, dropped when
        the queue is full: both reported as not stored."""
        start = time.perf_counter()
        self.reap(report, stats, block=False)
        keys = [d.key for _, d in dumps]
        if self.store.down_for_s() > 0:  # refused without IO: not worth the gathers
            stats.add("store_down_blocks", len(dumps))
            report.not_stored.update(keys)
            return
        nbytes = sum(d.num_tokens for _, d in dumps) * token_bytes
        if not self.has_room(nbytes):
            stats.add("dumps_dropped", len(dumps))
            report.not_stored.update(keys)
            return
        inject("dump")
        buffers = [gather(req, d) for req, d in dumps]
        task = self.store.dump([shard(k) for k in keys], [stored_bytes(b) for b in buffers],
                               [d.num_tokens for _, d in dumps], segments=buffers[0].shape[1] if buffers else 1)
        self.add(PendingDump(task, keys, buffers, nbytes))
        stats.add("dump_seconds", time.perf_counter() - start)
        stats.add("dumped_blocks", len(dumps))
        stats.add("dump_bytes", nbytes)

    def reap(self, report: UCMWorkerReport, stats: UCMConnectorStats, block: bool) -> None:
        """Moves the dumps the store has answered (all of them when `block`) into `report`."""
        still = []
        for p in self.pending:
            if not (block or self.store.check(p.task)):
                still.append(p)
                continue
            ok = self.store.wait(p.task)
            failed = len(ok) - sum(ok)
            self.pending_bytes -= p.nbytes
            for key, good in zip(p.keys, ok):
                if good:
                    report.stored[key] = 1
                else:
                    report.not_stored.add(key)
            if p.task.timed_out:  # a hung mount: the step goes on, the blocks may not be stored
                stats.add("dump_timeout_blocks", failed)
            if failed:  # a full store under capacity_gb refuses some on every step: say it once
                log = logger.debug if self._failure_logged else logger.warning
                self._failure_logged = True
                log("%d of %d KV blocks could not be stored (store full or failing: see the store's "
                    "statistics; further occurrences are logged at debug level)", failed, len(ok))
        self.pending = still
