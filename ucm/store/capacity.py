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
from dataclasses import dataclass

from ucm.store.layout import ScannedFile
from ucm.store.usage_ledger import UsageLedger

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    size: int
    stamp: float  # wall-clock time of the last use we know of


class CapacityLimiter:
    def __init__(self, capacity_bytes: int, ledger: UsageLedger | None = None,
                 on_full: Callable[[], None] | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0  # bytes of the files this process knows
        self._reserved = 0  # bytes of this process's dumps in flight
        self._lock = threading.Lock()
        self._ledger = ledger
        self._ledger_failed = False
        # Called when the store is full of files this process does not know (other writers',
        # written since its last scan): the housekeeper rescans at once.
        self._on_full = on_full

    @property
    def used_bytes(self) -> int:
        """The store's usage: the shared ledger's (every process), else this process's view."""
        shared = self._shared(lambda ledger: ledger.total())
        return self._used if shared is None else shared

    @property
    def reserved_bytes(self) -> int:
        """Bytes held for this process's dumps in flight (counted against the capacity)."""
        return self._reserved

    def _shared(self, op):
        """`op(ledger)`'s result; None without a usable ledger."""
        if self._ledger is None or self._ledger_failed:
            return None
        try:
            return op(self._ledger)
        except OSError as e:
            self._ledger_failed = True
            logger.warning("store usage ledger %s unusable (%s); capacity is kept per process from now on",
                           self._ledger.path, e)
            return None

    def scan_mark(self) -> int | None:
        """Taken before a directory scan, passed to reset_from_scan (the ledger's commit clock)."""
        return self._shared(lambda ledger: ledger.added())

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
            self._shared(lambda ledger: ledger.freed(removed_bytes))

    def reserve(self, sizes: list[int]) -> tuple[int, int]:
        """Evict least recently used files until the blocks of `sizes` fit; returns (evictions,
        n): the first n blocks fit and their bytes are reserved, the others must not be written
        (a batch larger than the room left, e.g. than the whole capacity, is cut, never let over).

        With a ledger the bytes are reserved there, so every process sees them. The caller must
        `release(reserved, kept)` once the writes are done, `kept` being the bytes actually
        written (successful writes are then `add`ed with their real size).
        """
        overshoot = False
        with self._lock:
            evicted = accepted = 0
            incoming = sum(sizes)

            def make_room(total: int) -> tuple[int, int]:  # the shared usage, under the ledger's lock
                nonlocal evicted, accepted
                freed_total, evicted = self._evict(total + incoming - self.capacity_bytes)
                room, taken = self.capacity_bytes - (total - freed_total), 0
                for size in sizes:
                    if taken + size > room:
                        break
                    taken += size
                    accepted += 1
                if not accepted and sizes and not self._files and not self._reserved:
                    # Full of other writers' files this process has not scanned yet: one block
                    # over the limit (per process, at most one in flight) instead of refusing
                    # every dump until the next scan, which is asked for now and evicts it back.
                    nonlocal overshoot
                    overshoot, accepted, taken = True, 1, sizes[0]
                return freed_total, taken

            if self._shared(lambda ledger: ledger.reserve(make_room)) is None:  # this process alone
                make_room(self._used + self._reserved)
            self._reserved += sum(sizes[:accepted])
        if overshoot and self._on_full is not None:
            self._on_full()
        return evicted, accepted

    def set_on_full(self, callback: Callable[[], None]) -> None:
        self._on_full = callback

    def trim(self) -> int:
        """Evicts known files while the shared usage is over the limit (an admitted overshoot,
        or writes this process learnt of by a scan); returns the evictions."""
        with self._lock:
            evicted = 0

            def make_room(total: int) -> tuple[int, int]:
                nonlocal evicted
                freed_total, evicted = self._evict(total - self.capacity_bytes)
                return freed_total, 0

            if self._shared(lambda ledger: ledger.reserve(make_room)) is None:
                make_room(self._used + self._reserved)
        return evicted

    def over_capacity(self) -> bool:
        return self.used_bytes > self.capacity_bytes

    def release(self, incoming: int, kept: int = 0) -> None:
        with self._lock:
            self._reserved -= incoming
        if incoming:
            self._shared(lambda ledger: ledger.release(incoming, kept))

    def _evict(self, excess: int) -> tuple[int, int]:
        """Evicts least recently used known files until `excess` bytes are freed or none is
        left; returns (bytes freed, evictions)."""
        freed_total = evictions = 0
        while self._files and freed_total < excess:
            freed = self._evict_oldest()
            if freed is not None:
                freed_total += freed
                evictions += 1
        return freed_total, evictions

    def _evict_oldest(self) -> int | None:
        """Unlink the least recently used file unless someone used it since we last looked;
        returns the bytes freed (None: nothing freed, the candidate moved or vanished)."""
        path, entry = next(iter(self._files.items()))
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            self._drop(path)
            return None
        except OSError as e:
            logger.warning("cannot stat %s for eviction: %s", path, e)
            self._drop(path)
            return None
        if mtime > entry.stamp:  # another process used it since we last looked
            entry.stamp = mtime
            self._files.move_to_end(path)
            return None
        freed = None
        try:
            os.unlink(path)
            freed = entry.size
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("cannot evict %s: %s", path, e)
        self._drop(path)
        return freed

    def _drop(self, path: str) -> None:
        entry = self._files.pop(path)
        self._used -= entry.size
