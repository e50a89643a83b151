"""What a finished, refused or timed-out store task did: per-key results, the store's statistics,
the capacity it reserved, corrupt files removed and unreadable blocks quarantined.

Kept apart from `nfs_store.py`, which submits the IO: this half only accounts for its outcome,
under one lock, whichever thread the outcome arrives on (a caller's `wait`, or the mount watch
reaping a task that returned after its deadline).
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import threading
import time
from dataclasses import dataclass

from ucm.store.base import StoreStats, Task
from ucm.store.block_format import CORRUPT_STATUSES, IoStatus, file_size
from ucm.store.capacity import CapacityLimiter
from ucm.store.dram_store import DramStore

logger = logging.getLogger("ucm.store.nfs_store")

# A block whose read failed with an IO error (not a checksum: those are removed) is a miss in
# this process for this long, so it is not read, failed and recomputed on every request.
QUARANTINE_S = 300.0


@dataclass(slots=True)
class LoadContext:
    paths: list[str]
    views: list  # per block: its destination, or (partial) its segments' destinations
    submit_seconds: float
    first: int = 0  # a load of segments `first...` of blocks of `total` (0: whole blocks)
    total: int = 0

    @property
    def partial(self) -> bool:
        return self.total > 0

    def nbytes(self, i: int) -> int:
        return sum(len(v) for v in self.views[i]) if self.partial else len(self.views[i])

    def whole_block(self, i: int) -> memoryview | None:
        """Block i's bytes when this load read all of it (a copy when it came in segments), else None."""
        if not self.partial:
            return self.views[i]
        return memoryview(b"".join(self.views[i])) if self.first == 0 and len(self.views[i]) == self.total else None


@dataclass(slots=True)
class DumpContext:
    paths: list[str]
    sizes: list[int]
    reserved: int
    over: set[int]  # positions not written: no room under the capacity


class OnceLog:
    """Warnings given once per tag: a full disk or a hung mount must not flood the log."""

    def __init__(self) -> None:
        self._seen: set[tuple] = set()

    def warn(self, tag: tuple, msg: str, *args, level: int = logging.WARNING) -> None:
        if tag in self._seen:
            return
        self._seen.add(tag)
        logger.log(level, msg, *args)

    def io_failure(self, op: str, status: int, err: int, path: str) -> None:
        """One warning per (operation, status, errno)."""
        reason = os.strerror(err) if err else IoStatus(status).name
        self.warn((op, int(status), int(err)),
                  "%s failed for %s: %s (%s); further %s failures of this kind are only counted in stats()",
                  op, path, reason, errno_mod.errorcode.get(err, IoStatus(status).name), op)


class TaskOutcomes:
    """The store's statistics and quarantine, and how each task's outcome changes them."""

    def __init__(self, limiter: CapacityLimiter | None, dram: DramStore | None, log: OnceLog):
        self.stats = StoreStats()
        self.lock = threading.Lock()
        self._limiter = limiter
        self._dram = dram
        self._log = log
        self._quarantine: dict[bytes, float] = {}  # key -> monotonic time its quarantine ends

    def quarantined(self) -> set[bytes]:
        """Keys read with an IO error within the last QUARANTINE_S: misses without IO."""
        if not self._quarantine:
            return set()
        now = time.monotonic()
        with self.lock:
            self._quarantine = {k: t for k, t in self._quarantine.items() if t > now}
            return set(self._quarantine)

    def refused(self, task: Task) -> None:
        """A load or dump refused without IO while the store is down: misses (DRAM hits stay)."""
        task.refused = True
        task.results = [i in task.served_from_dram for i in range(len(task.keys))]
        refused = len(task.native_indices)
        with self.lock:
            self.stats.down_refusals += refused
            if task.kind == "load":
                self.stats.load_errors += refused
                self._count_dram_hits(task)
            else:
                self.stats.dump_errors += refused

    def load_timed_out(self, task: Task) -> None:
        """A load past its deadline: a miss for the caller (only DRAM-served keys are True)."""
        task.timed_out = True
        task.results = [i in task.served_from_dram for i in range(len(task.keys))]
        timed_out = len(task.native_indices)
        with self.lock:
            self.stats.load_timeouts += timed_out
            self.stats.load_errors += timed_out
            self._count_dram_hits(task)

    def dump_timed_out(self, task: Task) -> None:
        """A dump past its deadline: not stored as far as the caller knows (blocks that were
        already stored count as stored); its IO is accounted when it returns (`finish_dump`)."""
        task.timed_out = True
        task.results = stored_without_io(task)
        with self.lock:
            self.stats.dump_timeouts += len(task.native_indices)

    def finish_load(self, task: Task, statuses: list[int], errnos: list[int], tokens: list[int],
                    seconds: float) -> list[bool]:
        ctx: LoadContext = task.context
        results = [False] * len(task.keys)
        for i in task.served_from_dram:
            results[i] = True
        ok_bytes = sum(ctx.nbytes(i) for i in task.served_from_dram)
        corrupt = 0
        for j, (i, status, err) in enumerate(zip(task.native_indices, statuses, errnos)):
            path = ctx.paths[j]
            if status == IoStatus.OK:
                results[i] = True
                ok_bytes += ctx.nbytes(i)
                if self._limiter is not None:
                    self._limiter.touch(path)
                whole = ctx.whole_block(i) if self._dram is not None else None
                if whole is not None:  # blocks read whole, whatever their layout in memory
                    self._dram.put(task.keys[i], whole, tokens[j])
            elif status in CORRUPT_STATUSES:
                corrupt += 1
                self._remove_corrupt(path, IoStatus(status))
            elif status != IoStatus.NOT_FOUND:
                self._log.io_failure("load", status, err, path)
                if status == IoStatus.IO_ERROR:
                    with self.lock:
                        self._quarantine[task.keys[i]] = time.monotonic() + QUARANTINE_S
                        self.stats.quarantined += 1
        ok = sum(results)
        with self.lock:
            s = self.stats
            s.load_blocks += ok
            s.dram_hits += len(task.served_from_dram)
            s.load_bytes += ok_bytes
            s.load_seconds += seconds + ctx.submit_seconds
            s.load_errors += len(results) - ok
            s.checksum_errors += corrupt
        return results

    def finish_dump(self, task: Task, statuses: list[int], errnos: list[int], seconds: float) -> list[bool]:
        ctx: DumpContext = task.context
        if self._limiter is not None:
            kept = sum(file_size(ctx.sizes[i]) for i, st in zip(task.native_indices, statuses) if st == IoStatus.OK)
            self._limiter.release(ctx.reserved, kept)
        results = stored_without_io(task)
        written = written_bytes = 0
        skipped = len(task.keys) - len(task.native_indices) - len(ctx.over)
        for i, status, err in zip(task.native_indices, statuses, errnos):
            path = ctx.paths[i]
            if status in (IoStatus.OK, IoStatus.EXISTS):
                results[i] = True
                if status == IoStatus.OK:
                    written += 1
                    written_bytes += ctx.sizes[i]
                else:
                    skipped += 1
                if self._limiter is not None:
                    self._limiter.add(path, file_size(ctx.sizes[i]))
            else:
                self._log.io_failure("dump", status, err, path)
        with self.lock:
            s = self.stats
            s.dump_blocks += written + skipped
            s.dump_skipped += skipped
            s.dump_bytes += written_bytes
            s.dump_seconds += seconds
            s.dump_errors += len(results) - written - skipped
        return results

    def _count_dram_hits(self, task: Task) -> None:
        self.stats.load_blocks += len(task.served_from_dram)
        self.stats.dram_hits += len(task.served_from_dram)

    def _remove_corrupt(self, path: str, status: IoStatus) -> None:
        """A corrupt block would answer every lookup and fail every load; drop it to be recomputed."""
        logger.warning("corrupt block %s (%s); removing it", path, status.name)
        removed = 0
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
            removed = size
        except OSError:
            pass
        if self._limiter is not None:
            self._limiter.forget(path, removed)


def pinned_bytes(task: Task) -> int:
    """Bytes of caller buffers a task's IO may still touch."""
    ctx = task.context
    if isinstance(ctx, LoadContext):
        return sum(ctx.nbytes(i) for i in range(len(ctx.views)))
    return sum(ctx.sizes) if isinstance(ctx, DumpContext) else 0


def stored_without_io(task: Task) -> list[bool]:
    """Per key of a dump before its IO answers: True where it was stored already (not submitted),
    False where it was over the capacity or is being written."""
    submitted = set(task.native_indices)
    return [i not in submitted and i not in task.context.over for i in range(len(task.keys))]
