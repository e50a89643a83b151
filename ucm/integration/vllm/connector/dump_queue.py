"""A worker's dumps handed to the store and not yet written: their buffers, their bytes, and
what the store answered, for the scheduler's report.

Dumps are asynchronous (the store's IO threads write them while the next steps run), so their
gathered buffers must live until the store is done, and under cold traffic the queue must be
bounded: beyond `limit_bytes` a step's dumps are dropped (counted) rather than queued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ucm.integration.vllm.connector.metadata import UCMWorkerReport
from ucm.integration.vllm.connector.stats import UCMConnectorStats
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
