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
from collections.abc import Iterable
from dataclasses import dataclass

from ucm.store.layout import ScannedFile
from ucm.store.usage_ledger import UsageLedger

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    size: int
    stamp: float  # wall-clock time of the last use we know of


class CapacityLimiter:
    def __init__(self, capacity_bytes: int, ledger: UsageLedger | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0  # bytes of the files this process knows
        self._reserved = 0  # bytes of this process's dumps in flight
        self._lock = threading.Lock()
        self._ledger = ledger
        self._ledger_failed = False

    @property
    def used_bytes(self) -> int:
        """The store's usage: the shared ledger's (every process), else this process's view."""
        shared = self._shared(lambda used: used)
        return self._used if shared is None else shared

    def _shared(self, change) -> int | None:
        """`change` applied to the ledger under its lock; None without a usable ledger."""
        if self._ledger is None or self._ledger_failed:
            return None
        try:
            return self._ledger.update(change)
        except OSError as e:
            self._ledger_failed = True
            logger.warning("store usage ledger %s unusable (%s); capacity is kept per process from now on",
                           self._ledger.path, e)
            return None

    def reset_from_scan(self, files: Iterable[ScannedFile], scan_started: float) -> None:
        """Adopt a directory scan as the truth, keeping recency we know better than the mtimes
        and files we added while the scan ran (it may have passed their directory already)."""
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
            used, reserved = self._used, self._reserved
        self._shared(lambda _: used + reserved)  # what is on disk, plus this process's writes in flight

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
            self._shared(lambda used: used - removed_bytes)

    def reserve(self, incoming: int) -> int:
        """Evict least recently used files until `incoming` more bytes fit; returns evictions.

        With a ledger the bytes are reserved there, so every process sees them. The caller must
        `release(incoming, kept)` once the write is done, `kept` being the bytes actually written
        (successful writes are then `add`ed with their real size).
        """
        with self._lock:
            evicted = 0

            def fit(used: int) -> int:  # the shared usage, under the ledger's lock
                nonlocal evicted
                while self._files and used + incoming > self.capacity_bytes:
                    freed = self._evict_oldest()
                    if freed is not None:
                        used -= freed
                        evicted += 1
                return used + incoming

            if self._shared(fit) is None:  # this process's view alone
                while self._files and self._used + self._reserved + incoming > self.capacity_bytes:
                    if self._evict_oldest() is not None:
                        evicted += 1
            self._reserved += incoming
        return evicted

    def release(self, incoming: int, kept: int = 0) -> None:
        with self._lock:
            self._reserved -= incoming
        if incoming > kept:
            self._shared(lambda used: used - (incoming - kept))

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
