"""Keeps the block files of a shared directory under a byte limit by LRU eviction.

Recency is shared through file mtimes: readers touch a block's mtime (rate limited, in the
native engine), so an evicting process can tell that another process used a file since it
last looked. Usage is shared through the usage ledger (usage_ledger.py): whoever is about to
write reserves its bytes there and evicts until they fit, whatever other processes wrote. Each
process knows the files themselves (the eviction candidates) from its own writes and periodic
rescans, which also reconcile the ledger with what is on disk.
Deleting a file another process is reading is safe on POSIX (it keeps the old inode); on NFS
it may read ESTALE, which is an IO error for that key, never wrong bytes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ucm.store.deadline import DeadlineThread
from ucm.store.layout import ScannedFile
from ucm.store.usage_ledger import UsageLedger

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    size: int
    stamp: float  # wall-clock time of the last use we know of


# What `_shared` answers while the ledger's lock does not come within the deadline (a hung mount).
_HUNG = object()


@dataclass
class _Reservation:
    """One `reserve` call. The caller may stop waiting for the ledger while its call is still
    queued or running on the ledger's thread: `given_up` and `finished`, both under `lock`, decide
    which side owns the outcome (the caller uses it, or the ledger's thread takes it back)."""

    sizes: list[int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    given_up: bool = False
    finished: bool = False
    evicted: int = 0
    accepted: int = 0
    taken: int = 0  # bytes reserved
    overshoot: bool = False


class CapacityLimiter:
    def __init__(self, capacity_bytes: int, ledger: UsageLedger | None = None,
                 on_full: Callable[[], None] | None = None, ledger_timeout_s: float = 0.0):
        """`ledger_timeout_s` > 0: the ledger is used from a thread of its own and waited for at
        most that long (its `fcntl` lock blocks in a hung mount); 0 waits for ever."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0  # bytes of the files this process knows
        self._reserved = 0  # bytes of this process's dumps in flight
        # `_lock` guards the bookkeeping and is never held across a file-system call, so a mount
        # that hangs in an eviction's unlink does not block loads and dumps finishing (touch,
        # add); `_evicting` serialises whole evictions and reservations of this process.
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._ledger = ledger
        self._ledger_failed = False
        self._ledger_timeout_s = ledger_timeout_s
        self._ledger_calls = DeadlineThread("ucm-store-ledger") if ledger is not None and ledger_timeout_s else None
        # Called when the store is full of files this process does not know (other writers',
        # written since its last scan): the housekeeper rescans at once.
        self._on_full = on_full

    @property
    def used_bytes(self) -> int:
        """The store's usage: the shared ledger's (every process), else this process's view."""
        shared = self._shared(lambda ledger: ledger.total())
        return self._used if shared is None or shared is _HUNG else shared

    @property
    def reserved_bytes(self) -> int:
        """Bytes held for this process's dumps in flight (counted against the capacity)."""
        return self._reserved

    def _shared(self, op, queue_when_hung: bool = False):
        """`op(ledger)`'s result; None without a usable ledger; `_HUNG` when the ledger did not
        answer within `ledger_timeout_s` (the op still runs when it does; while an earlier op is
        still blocked, it runs later only if `queue_when_hung`)."""
        if self._ledger is None or self._ledger_failed:
            return None
        ledger = self._ledger
        try:
            if self._ledger_calls is None:
                return op(ledger)
            call = self._ledger_calls.run(lambda: op(ledger), self._ledger_timeout_s, queue_when_hung)
            if call is None:  # the store warns, once, when it refuses a dump for it
                return _HUNG
            return call.result()
        except OSError as e:
            self._ledger_failed = True
            logger.warning("store usage ledger %s unusable (%s); capacity is kept per process from now on",
                           self._ledger.path, e)
            return None

    def scan_mark(self) -> int | None:
        """Taken before a directory scan, passed to reset_from_scan (the ledger's commit clock)."""
        mark = self._shared(lambda ledger: ledger.added())
        return None if mark is _HUNG else mark

    def reset_from_scan(self, files: Iterable[ScannedFile], scan_started: float, mark: int | None = None) -> None:
        """Adopt a directory scan as the truth, keeping recency we know better than the mtimes
        and files we added while the scan ran (it may have passed their directory already)."""
        files = list(files)
        with self._lock:
            merged: dict[str, _Entry] = {}
            for f in files:
                known = self._files.get(f.path)
                merged[f.path] = _Entry(f.size, max(f.mtime, known.stamp) if known else f.mtime)
            for path, entry in self._files.items():
                if path not in merged and entry.stamp >= scan_started:
                    merged[path] = entry
            self._files = OrderedDict(sorted(merged.items(), key=lambda kv: kv[1].stamp))
            self._used = sum(e.size for e in self._files.values())
        on_disk = sum(f.size for f in files)
        if mark is not None:
            self._shared(lambda ledger: ledger.reconcile(on_disk, mark))
        self.trim()

    def touch(self, path: str) -> None:
        with self._lock:
            entry = self._files.get(path)
            if entry is not None:
                entry.stamp = time.time()
                self._files.move_to_end(path)

    def add(self, path: str, size: int) -> None:
        with self._lock:
            old = self._files.pop(path, None)
            if old is not None:
                self._used -= old.size
            self._files[path] = _Entry(size, time.time())
            self._used += size

    def forget(self, path: str, removed_bytes: int = 0) -> None:
        """`path` is gone; `removed_bytes`: what this process's unlink of it freed."""
        with self._lock:
            old = self._files.pop(path, None)
            if old is not None:
                self._used -= old.size
        if removed_bytes:
            self._shared(lambda ledger: ledger.freed(removed_bytes), queue_when_hung=True)

    def reserve(self, sizes: list[int]) -> tuple[int, int, bool]:
        """Evict least recently used files until the blocks of `sizes` fit; returns (evictions,
        n, hung): the first n blocks fit and their bytes are reserved, the others must not be written
        (a batch larger than the room left, e.g. than the whole capacity, is cut, never let over).

        With a ledger the bytes are reserved there, so every process sees them. The caller must
        `release(reserved, kept)` once the writes are done, `kept` being the bytes actually
        written (successful writes are then `add`ed with their real size). A ledger that does not
        answer within `ledger_timeout_s` fits nothing (hung: a hung mount gets no writes); if its
        reservation is made after all, the ledger's thread takes it back.
        """
        r = _Reservation(list(sizes))

        def make_room(total: int) -> tuple[int, int]:  # the shared usage, under the ledger's lock
            with r.lock:
                if r.given_up:
                    return 0, 0
            with self._evicting:
                return self._make_room(r, total)

        def on_ledger(ledger: UsageLedger) -> int:
            total = ledger.reserve(make_room)
            with r.lock:
                r.finished = True
                orphaned = r.given_up and r.taken
            if orphaned:
                self._take_back(ledger, r.taken)
            return total

        shared = self._shared(on_ledger)
        if shared is None:  # this process alone (or the ledger failed: start over without it)
            with self._evicting:
                with self._lock:
                    self._reserved -= r.taken
                    r.accepted = r.taken = 0
                    r.overshoot = False
                    total = self._used + self._reserved
                self._make_room(r, total)
        elif shared is _HUNG:
            with r.lock:
                if not r.finished:  # the ledger's thread owns whatever it reserves from now on
                    r.given_up = True
                    return 0, 0, True
        if r.overshoot and self._on_full is not None:
            self._on_full()
        return r.evicted, r.accepted, False

    def _make_room(self, r: _Reservation, total: int) -> tuple[int, int]:
        """Under `_evicting`: evicts for `r` against the usage `total`, decides what fits and
        reserves it here; returns (bytes freed, bytes reserved)."""
        incoming = sum(r.sizes)
        freed_total, r.evicted = self._evict(total + incoming - self.capacity_bytes)
        room, taken = self.capacity_bytes - (total - freed_total), 0
        for size in r.sizes:
            if taken + size > room:
                break
            taken += size
            r.accepted += 1
        with self._lock:
            if not r.accepted and r.sizes and not self._files and not self._reserved:
                # Full of other writers' files this process has not scanned yet: one block
                # over the limit (per process, at most one in flight) instead of refusing
                # every dump until the next scan, which is asked for now and evicts it back.
                r.overshoot, r.accepted, taken = True, 1, r.sizes[0]
            r.taken = taken
            self._reserved += taken
        return freed_total, taken

    def _take_back(self, ledger: UsageLedger, taken: int) -> None:
        """A reservation whose caller stopped waiting: nothing will be written for it."""
        with self._lock:
            self._reserved -= taken
        ledger.release(taken, 0)

    def close(self) -> None:
        """Ends the ledger's thread once the calls queued so far are done."""
        if self._ledger_calls is not None:
            self._ledger_calls.close()

    def set_on_full(self, callback: Callable[[], None]) -> None:
        self._on_full = callback

    def trim(self) -> int:
        """Evicts known files while the shared usage is over the limit (an admitted overshoot,
        or writes this process learnt of by a scan); returns the evictions."""
        evicted = 0

        def make_room(total: int | None) -> tuple[int, int]:  # None: this process's own view
            nonlocal evicted
            with self._evicting:
                if total is None:
                    with self._lock:
                        total = self._used + self._reserved
                freed_total, evicted = self._evict(total - self.capacity_bytes)
            return freed_total, 0

        if self._shared(lambda ledger: ledger.reserve(make_room)) is None:
            make_room(None)
        return evicted

    def over_capacity(self) -> bool:
        return self.used_bytes > self.capacity_bytes

    def release(self, incoming: int, kept: int = 0) -> None:
        with self._lock:
            self._reserved -= incoming
        if incoming:
            self._shared(lambda ledger: ledger.release(incoming, kept), queue_when_hung=True)

    def _evict(self, excess: int) -> tuple[int, int]:
        """Evicts least recently used known files until `excess` bytes are freed or none is
        left; returns (bytes freed, evictions). Under `_evicting`, not `_lock`."""
        freed_total = evictions = 0
        while freed_total < excess:
            with self._lock:
                if not self._files:
                    break
                path, entry = next(iter(self._files.items()))
                stamp, size = entry.stamp, entry.size
            freed = self._evict_file(path, stamp, size)
            if freed is not None:
                freed_total += freed
                evictions += 1
        return freed_total, evictions

    def _evict_file(self, path: str, stamp: float, size: int) -> int | None:
        """Unlink the least recently used file `path` unless someone used it since we last
        looked (`stamp`); returns the bytes freed (None: nothing freed, the candidate moved or
        vanished). The file-system calls run outside `_lock`."""
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            self._drop(path)
            return None
        except OSError as e:
            logger.warning("cannot stat %s for eviction: %s", path, e)
            self._drop(path)
            return None
        with self._lock:
            entry = self._files.get(path)
            if entry is None or entry.stamp != stamp:  # gone, or used here, while we looked
                return None
            if mtime > stamp:  # another process used it since we last looked
                entry.stamp = mtime
                self._files.move_to_end(path)
                return None
        freed = None
        try:
            os.unlink(path)
            freed = size
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("cannot evict %s: %s", path, e)
        self._drop(path)
        return freed

    def _drop(self, path: str) -> None:
        with self._lock:
            entry = self._files.pop(path, None)
            if entry is not None:
                self._used -= entry.size
