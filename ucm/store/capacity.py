"""Keeps the block files of a shared directory under a byte limit by LRU eviction.

Recency is shared through file mtimes: readers touch a block's mtime (rate limited, in the
native engine), so an evicting process can tell that another process used a file since it
last looked. Each process tracks usage in memory (its own writes + periodic rescans, which
also pick up other writers' files), and whoever is about to write evicts until its write fits.
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

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    size: int
    stamp: float  # wall-clock time of the last use we know of


class CapacityLimiter:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0
        self._reserved = 0  # bytes of dumps in flight
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

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

    def forget(self, path: str) -> None:
        with self._lock:
            old = self._files.pop(path, None)
            if old is not None:
                self._used -= old.size

    def reserve(self, incoming: int) -> int:
        """Evict least recently used files until `incoming` more bytes fit; returns evictions.

        The caller must `release(incoming)` once the write is done (successful writes are then
        `add`ed with their real size).
        """
        evicted = 0
        with self._lock:
            while self._files and self._used + self._reserved + incoming > self.capacity_bytes:
                path, entry = next(iter(self._files.items()))
                try:
                    mtime = os.stat(path).st_mtime
                except FileNotFoundError:
                    self._drop(path)
                    continue
                except OSError as e:
                    logger.warning("cannot stat %s for eviction: %s", path, e)
                    self._drop(path)
                    continue
                if mtime > entry.stamp:  # another process used it since we last looked
                    entry.stamp = mtime
                    self._files.move_to_end(path)
                    continue
                try:
                    os.unlink(path)
                    evicted += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("cannot evict %s: %s", path, e)
                self._drop(path)
            self._reserved += incoming
        return evicted

    def release(self, incoming: int) -> None:
        with self._lock:
            self._reserved -= incoming

    def _drop(self, path: str) -> None:
        entry = self._files.pop(path)
        self._used -= entry.size
