"""UcmNfsStore: KV blocks shared by many processes and machines through one directory tree.

Python decides paths, eviction and stats; the native engine (csrc/store_io.cpp) moves and
verifies the bytes on its own threads. Guarantees:
  * a block becomes visible only complete (temp file in the same directory + rename);
  * a load reports True only for bytes whose length, key and XXH64 matched the header;
  * every per-key failure is a False in `wait` plus a counter in `stats`, never an exception.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ucm.cpus import other_cpus
from ucm.store.base import BlockMeta, Buffer, KVStoreBase, StoreStats, Task, byte_view, validate_keys
from ucm.store.block_format import MAX_SEGMENTS, file_size, read_header
from ucm.store.capacity import CapacityLimiter
from ucm.store.config import LOAD_GRACE_S, NfsStoreConfig
from ucm.store.dram_store import DramStore
from ucm.store.housekeeping import Housekeeper
from ucm.store.layout import BlockLayout
from ucm.store.mount_watch import MountWatch
from ucm.store.roots import lost_root, open_root
from ucm.store.task_outcomes import DumpContext, LoadContext, OnceLog, TaskOutcomes, pinned_bytes
from ucm.store.usage_ledger import UsageLedger

try:
    from ucm.store import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "ucm.store._native is not built; run `pip install -e .` or `python setup.py build_ext --inplace`"
    ) from e

# A root found intact is taken as intact this long: dumps within it skip the check.
ROOT_CHECK_S = 1.0

logger = logging.getLogger(__name__)


class UcmNfsStore(KVStoreBase):
    def __init__(self, config: NfsStoreConfig | Mapping[str, Any]):
        self.config = config if isinstance(config, NfsStoreConfig) else NfsStoreConfig.from_dict(config)
        cfg = self.config
        self._layout = BlockLayout(cfg.storage_backends)
        # Identity of every backend root: a lost mount or a deleted directory must not move the
        # store to whatever is at the same path now (the local disk, a fresh empty tree).
        self._roots = {backend: open_root(backend) for backend in self._layout.backends}
        self._roots_checked_at = -ROOT_CHECK_S  # when the roots were last found intact
        # The ledger's lock is a metadata call like a lookup: it gets the lookups' deadline.
        self._limiter = (CapacityLimiter(cfg.capacity_bytes, UsageLedger(self._layout.backends[0]),
                                         ledger_timeout_s=cfg.lookup_timeout_s)
                         if cfg.capacity_bytes else None)
        self._dram = DramStore(cfg.dram_capacity_bytes) if cfg.dram_capacity_bytes > 0 else None
        # Created from vLLM's bound worker thread, the IO threads would share its one core.
        others = other_cpus()
        io_cpus = sorted(others | os.sched_getaffinity(0)) if others else []
        self._engine = _native.IoEngine(cfg.io_threads, cfg.io_direct, cfg.fsync, cfg.touch_interval_s, io_cpus)
        self._log = OnceLog()
        self._outcomes = TaskOutcomes(self._limiter, self._dram, self._log)
        self._closed = False
        # Deadlines, timed-out tasks and the down state of a mount that may stop answering.
        self._watch = MountWatch(self._layout.backends[0], cfg.lookup_timeout_s, cfg.down_backoff_s,
                                 cfg.down_backoff_max_s, lambda t: self._engine.poll(t.native_id),
                                 lambda t: self._engine.wait(t.native_id), self._late_outcome, self._log.warn,
                                 probe=self._roots_intact)
        self._pid = os.getpid()
        self._housekeeper = Housekeeper(self._layout, self._limiter, cfg.temp_grace_s, cfg.usage_rescan_s)
        if self._limiter is not None:
            self._limiter.set_on_full(self._housekeeper.request_scan)
        self._housekeeper.start()

    # -- KVStoreBase ---------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        keys = validate_keys(keys)
        self._check_open()
        found = [False] * len(keys)
        if self._dram is not None:
            found = [self._dram.contains(k) for k in keys]
        quarantined = self._outcomes.quarantined()
        todo = [i for i, f in enumerate(found) if not f and keys[i] not in quarantined]
        down = bool(todo) and self._watch.down()
        on_disk = None if down else self._exists([self._layout.block_path(keys[i]) for i in todo])
        for i, hit in zip(todo, on_disk or ()):
            found[i] = hit
        with self._outcomes.lock:
            self._outcomes.stats.count_lookup(found)
            if down:
                self._outcomes.stats.down_refusals += len(todo)
            elif on_disk is None:
                self._outcomes.stats.lookup_timeouts += len(todo)
        return found

    def load(self, keys: Sequence[bytes], destinations: Sequence[Buffer]) -> Task:
        keys = validate_keys(keys)
        self._check_open()
        if len(destinations) != len(keys):
            raise ValueError(f"load: {len(keys)} keys but {len(destinations)} destinations")
        views = [_view(d, i, "destination", writable=True) for i, d in enumerate(destinations)]
        return self._start_load(keys, views, None if self._dram is None else self._dram.get_into,
                                self._engine.submit_read)

    def load_segments(self, keys: Sequence[bytes], destinations: Sequence[Sequence[Buffer]], first: int,
                      total: int) -> Task:
        keys = validate_keys(keys)
        self._check_open()
        if len(destinations) != len(keys):
            raise ValueError(f"load_segments: {len(keys)} keys but {len(destinations)} destination lists")
        views = [[_view(d, i, "destination", writable=True) for d in parts] for i, parts in enumerate(destinations)]
        dram = self._dram
        return self._start_load(keys, views,
                                None if dram is None else lambda key, parts: dram.get_segments_into(key, parts, first, total),
                                lambda k, p, v: self._engine.submit_read_segments(k, p, v, first, total),
                                segments=(first, total))

    def _start_load(self, keys: list[bytes], views: list, from_dram, submit,
                    segments: tuple[int, int] | None = None) -> Task:
        """A load of `views` (per key: a destination, or with `segments` (first, total): its segments' destinations):
        from the DRAM tier where `from_dram(key, view)` copies it, the rest submitted to the IO threads."""
        t0 = time.perf_counter()
        task = Task("load", keys)
        if from_dram is not None:
            task.served_from_dram = {i for i, (key, view) in enumerate(zip(keys, views)) if from_dram(key, view)}
        task.native_indices = [i for i in range(len(keys)) if i not in task.served_from_dram]
        if task.native_indices and self._watch.refusing_io():
            return self._refused(task)
        paths = [self._layout.block_path(keys[i]) for i in task.native_indices]
        task.native_id = submit([keys[i] for i in task.native_indices], paths, [views[i] for i in task.native_indices])
        task.context = LoadContext(paths, views, time.perf_counter() - t0, *(segments or (0, 0)))
        return task

    def dump(self, keys: Sequence[bytes], sources: Sequence[Buffer], token_counts: Sequence[int],
             segments: int = 1) -> Task:
        keys = validate_keys(keys)
        self._check_open()
        if not len(keys) == len(sources) == len(token_counts):
            raise ValueError(f"dump: {len(keys)} keys, {len(sources)} sources, {len(token_counts)} token_counts")
        views = [_view(s, i, "source", writable=False) for i, s in enumerate(sources)]
        tokens = [int(t) for t in token_counts]
        if any(t < 0 for t in tokens):
            raise ValueError("dump: token_counts must be >= 0")
        if not 1 <= segments <= MAX_SEGMENTS or any(len(v) % segments for v in views):
            raise ValueError(f"dump: segments={segments}: every source must split into that many equal "
                             f"segments (1..{MAX_SEGMENTS})")
        if self._dram is not None:
            for key, view, t in zip(keys, views, tokens):
                self._dram.put(key, view, t)
        paths = [self._layout.block_path(k) for k in keys]
        task = Task("dump", keys)
        if keys and self._watch.refusing_io():
            task.native_indices = list(range(len(keys)))
            return self._refused(task)
        # Blocks already stored are skipped before capacity is reserved: re-dumping them must not
        # evict others (the native engine still skips any that appear meanwhile). The check, and
        # that of the roots, is a lookup with its timeout: a mount that does not answer gets no
        # writes, and the caller does not wait for it.
        checked = self._watch.metadata(lambda: (self._engine.exists(paths), self._roots_intact()), "dump check") \
            if paths else ([], True)
        present, intact = checked if checked is not None else (None, False)
        if present is None or not intact:
            task.results = [False] * len(keys)
            task.timed_out = present is None
            with self._outcomes.lock:
                self._outcomes.stats.dump_errors += len(keys)
                if present is None:
                    self._outcomes.stats.lookup_timeouts += len(keys)
            return task
        task.native_indices = [i for i, p in enumerate(present) if not p]
        new = task.native_indices
        over: list[int] = []
        sizes = [file_size(len(views[i])) for i in new]
        if self._limiter is not None and new:
            evicted, fit, hung = self._limiter.reserve(sizes)
            if hung:  # the usage ledger's lock did not come: a hung mount gets no writes
                task.results = [bool(p) for p in present]  # stored already, or not at all
                task.timed_out = True
                self._watch.trip("usage ledger lock")
                with self._outcomes.lock:
                    self._outcomes.stats.dump_errors += len(new)
                    self._outcomes.stats.ledger_timeouts += len(new)
                    self._outcomes.stats.dump_blocks += len(keys) - len(new)
                    self._outcomes.stats.dump_skipped += len(keys) - len(new)
                self._log.warn(("ledger timeout",), "store usage ledger not answered within lookup_timeout_s=%g s "
                               "(hung mount?): dump of %d blocks refused, and every dump until it answers; "
                               "further refusals are only counted in stats().ledger_timeouts",
                               self.config.lookup_timeout_s, len(new))
                return task
            new, over, sizes = new[:fit], new[fit:], sizes[:fit]
            task.native_indices = new
            with self._outcomes.lock:
                self._outcomes.stats.evictions += evicted
                self._outcomes.stats.dump_over_capacity += len(over)
        reserved = sum(sizes)
        try:
            task.native_id = self._engine.submit_write(
                [keys[i] for i in new], [self._layout.temp_path(keys[i]) for i in new], [paths[i] for i in new],
                [views[i] for i in new], [tokens[i] for i in new], [segments] * len(new) if segments > 1 else []
            )
        except BaseException:
            if self._limiter is not None:
                self._limiter.release(reserved)
            raise
        task.context = DumpContext(paths, [len(v) for v in views], reserved, set(over))
        return task

    @property
    def metadata_timeout_s(self) -> float | None:
        return self.config.lookup_timeout_s or None

    def wait(self, task: Task, timeout_s: float | None = None) -> list[bool]:
        if task.results is not None:
            return list(task.results)
        self._watch.reap()
        if timeout_s is None:
            timeout_s = self.load_deadline_s(task) if task.kind == "load" else self.config.dump_timeout_s
        done = self._engine.wait(task.native_id, timeout_s or -1.0)
        if done is None:
            return self._abandon(task, timeout_s) if task.kind == "load" else self._abandon_dump(task)
        statuses, errnos, tokens, seconds = done
        self._watch.answered()
        if task.kind == "load":
            results = self._outcomes.finish_load(task, statuses, errnos, tokens, seconds)
        else:
            results = self._outcomes.finish_dump(task, statuses, errnos, seconds)
            if not all(results):  # a lost root shows first as failed writes: the next dump checks it
                self._roots_checked_at = -ROOT_CHECK_S
        self._log_direct_fallback()
        task.results = results
        return list(results)

    def load_deadline_s(self, task: Task) -> float | None:
        """load_timeout_s, or less for a small load: LOAD_GRACE_S plus its bytes at load_min_mb_s."""
        cfg = self.config
        if not cfg.load_timeout_s:
            return None
        if not cfg.load_min_mb_s or task.context is None:
            return cfg.load_timeout_s
        nbytes = sum(task.context.nbytes(i) for i in task.native_indices)
        return min(cfg.load_timeout_s, LOAD_GRACE_S + nbytes / (cfg.load_min_mb_s * 1e6))

    def check(self, task: Task) -> bool:
        return task.results is not None or self._engine.poll(task.native_id)

    def stats(self) -> StoreStats:
        with self._outcomes.lock:
            stats = self._outcomes.stats.copy()
        stats.down_trips = self._watch.breaker.trips
        return stats

    def down_for_s(self) -> float:
        """Seconds the store still counts as down (0 while it answers); see breaker.py."""
        return self._watch.down_for_s()

    def hold_down(self, seconds: float) -> None:
        """Count the store as down for `seconds` on another process's word (a worker whose load
        or dump timed out tells the scheduler's store, whose lookups still answer)."""
        self._watch.breaker.hold(seconds)

    def close(self) -> None:
        """Lets queued dumps finish, stops the background scan; un-waited tasks are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._limiter is not None and self._limiter.over_capacity():  # an overshoot not evicted yet
            self._housekeeper.scan_once()
        self._housekeeper.stop()
        self._watch.close()
        self._watch.reap()
        if self._limiter is not None:  # after the reaped dumps' ledger updates
            self._limiter.close()
        hung_lookup, abandoned = self._watch.lookup_hung, self._watch.count()
        if abandoned or hung_lookup:  # joining the IO threads would hang on the same IO
            logger.warning("%d timed-out store loads or dumps%s still blocked in IO; leaving their threads",
                           abandoned, " and a lookup are" if hung_lookup else " are")
        else:
            self._engine.close()
        if self._dram is not None:
            self._dram.close()

    # -- extras --------------------------------------------------------------------------
    def read_meta(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        """Payload length and token count of stored blocks (None where absent or unreadable)."""
        out: list[BlockMeta | None] = []
        for key in validate_keys(keys):
            meta = self._dram.meta(key) if self._dram is not None else None
            if meta is None:
                try:
                    header = read_header(self._layout.block_path(key))
                    if header.key == key:
                        meta = BlockMeta(header.payload_len, header.token_count)
                except (OSError, ValueError):
                    pass
            out.append(meta)
        return out

    def block_path(self, key: bytes) -> str:
        return self._layout.block_path(key)

    def wait_open_scan(self, timeout: float | None = None) -> bool:
        """Wait for the scan started at open (abandoned temp files removed, usage known)."""
        return self._housekeeper.first_scan_done.wait(timeout)

    def rescan(self) -> int:
        """Scan the directories now (usage + abandoned temp files); returns temp files removed."""
        return self._housekeeper.scan_once()

    def abandoned(self, kind: str) -> int:
        """Timed-out tasks of `kind` ("load" or "dump") whose IO has not returned yet (their
        buffers are still pinned)."""
        if kind not in ("load", "dump"):
            raise ValueError(f"kind must be 'load' or 'dump', got {kind!r}")
        self._watch.reap()
        return self._watch.count(kind)

    @property
    def used_bytes(self) -> int | None:
        """Bytes of block files as this process believes them (None without a capacity limit)."""
        return None if self._limiter is None else self._limiter.used_bytes

    @property
    def reserved_bytes(self) -> int | None:
        """Capacity held for this process's dumps in flight (None without a capacity limit)."""
        return None if self._limiter is None else self._limiter.reserved_bytes

    # -- internals -----------------------------------------------------------------------
    def _exists(self, paths: list[str]) -> list[bool] | None:
        """Which block files exist, within `lookup_timeout_s`; None (all misses) past it, and at
        once while an earlier lookup is still blocked in the file system."""
        if not paths:
            return []
        return self._watch.metadata(lambda: self._engine.exists(paths), f"lookup of {len(paths)} blocks")

    def _refused(self, task: Task) -> Task:
        self._outcomes.refused(task)
        return task

    def _abandon(self, task: Task, timeout_s: float) -> list[bool]:
        self._outcomes.load_timed_out(task)
        self._watch.abandon(task, pinned_bytes(task), f"load of {len(task.native_indices)} blocks")
        self._log.warn(("load timeout",), "store load of %d blocks not done after %g s (hung or overloaded "
                       "mount?); they count as misses and are recomputed; further timeouts are only counted in "
                       "stats().load_timeouts", len(task.native_indices), timeout_s)
        return list(task.results)

    def _abandon_dump(self, task: Task) -> list[bool]:
        self._outcomes.dump_timed_out(task)
        self._watch.abandon(task, pinned_bytes(task), f"dump of {len(task.native_indices)} blocks")
        self._log.warn(("dump timeout",), "store dump of %d blocks not done after dump_timeout_s=%g s (hung or "
                       "overloaded mount?); not waiting for it (they may not be stored, and are recomputed if "
                       "so); further timeouts are only counted in stats().dump_timeouts", len(task.native_indices),
                       self.config.dump_timeout_s)
        return list(task.results)

    def _late_outcome(self, task: Task, outcome) -> None:
        """A timed-out task's IO returned: a dump's outcome is accounted now (its statistics and
        the capacity it reserved); a load's buffers are simply released."""
        if task.kind == "dump":
            statuses, errnos, _, seconds = outcome
            self._outcomes.finish_dump(task, statuses, errnos, seconds)

    def _log_direct_fallback(self) -> None:
        if self.config.io_direct and _native.direct_io_fallbacks() > 0:
            self._log.warn(("O_DIRECT",), "O_DIRECT refused by the filesystem under %s; using buffered IO",
                           self._layout.backends)

    def _roots_intact(self) -> bool:
        """Whether every root is still the one opened: checked before a dump, at most once per
        ROOT_CHECK_S while they are (each check is a stat and a read, round trips on NFS)."""
        if time.monotonic() - self._roots_checked_at < ROOT_CHECK_S:
            return True
        lost = lost_root(self._roots)
        if lost is None:
            self._roots_checked_at = time.monotonic()
        if lost is not None:
            self._log.warn(("root lost",), "store root %s is gone or was replaced (unmounted, deleted or "
                           "re-created); refusing to write there: dumps fail and requests are recomputed",
                           lost, level=logging.ERROR)
        return lost is None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("UcmNfsStore is closed")
        if os.getpid() != self._pid:
            # A forked child inherits the engine without its threads: every wait would hang.
            raise RuntimeError("UcmNfsStore was created in another process; create one per process after fork")


def _view(buf: Buffer, i: int, what: str, writable: bool) -> memoryview:
    try:
        return byte_view(buf, writable=writable)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} {i}: {e}") from e
