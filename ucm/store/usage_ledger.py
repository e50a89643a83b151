"""The store's byte usage, shared by every process on the directory through one locked file.

Each process used to count its own writes between rescans, so N writers could fill N times the
limit. The ledger (`<first backend>/.ucm-usage`) holds the bytes of stored blocks (`committed`)
and each writer's reservations (bytes it is about to write, per `host:pid`), read and updated
under an exclusive `fcntl` lock, which NFS (v4, or v3 with lockd) serialises across hosts. A
writer reserves before writing and evicts until committed + every reservation fits; when the
write is done it turns the bytes it kept into committed ones. Evictions subtract what they freed.
Rescans set `committed` to what they found on disk plus every block committed while they ran
(`added` counts commits), and leave other writers' reservations alone; a block the scan saw and
whose writer released it meanwhile, or a block evicted meanwhile that the scan saw, is then
counted twice until the next rescan: the error is always on the safe side (less is stored). Reservations of writers that died (pid gone on this host, or not
refreshed for `STALE_S` on another) are dropped by rescans.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ucm.store.liveness import pid_alive

LEDGER_NAME = ".ucm-usage"
STALE_S = 600.0  # a reservation not refreshed for this long belongs to a dead writer on another host

# fcntl record locks belong to the process, not the thread: two threads (or two stores on one
# directory) of a process would both "hold" the lock at once, and the kernel may report a false
# deadlock. One thread lock per ledger file serialises them first.
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock(path: str) -> threading.Lock:
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(os.path.realpath(path), threading.Lock())


@dataclass
class Usage:
    committed: int = 0  # bytes of stored blocks
    reserved: dict[str, list[float]] = field(default_factory=dict)  # "host:pid" -> [bytes, last update]
    added: int = 0  # bytes ever committed by writers (a clock for scans)

    @property
    def total(self) -> int:
        return self.committed + int(sum(r[0] for r in self.reserved.values()))

    @classmethod
    def parse(cls, raw: bytes) -> Usage:
        raw = raw.strip(b"\0 \n")
        if raw.isdigit():  # the ledger of earlier versions: one number
            return cls(int(raw))
        try:
            d = json.loads(raw)
            return cls(int(d["committed"]), {str(k): [float(v[0]), float(v[1])] for k, v in d["reserved"].items()},
                       int(d.get("added", 0)))
        except (ValueError, KeyError, TypeError, IndexError):
            return cls()  # damaged: rescans rebuild it

    def dump(self) -> bytes:
        return json.dumps({"committed": self.committed, "reserved": self.reserved, "added": self.added},
                          separators=(",", ":")).encode()


class UsageLedger:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, LEDGER_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        os.close(fd)
        self.host = socket.gethostname()
        self._thread_lock = _thread_lock(self.path)

    @property
    def owner(self) -> str:
        return f"{self.host}:{os.getpid()}"  # at call time: a forked child is another writer

    def update(self, change: Callable[[Usage], None]) -> Usage:
        """Under the lock: read the usage, let `change` modify it, write it back; returns it."""
        with self._thread_lock:
            return self._update_locked(change)

    def _update_locked(self, change: Callable[[Usage], None]) -> Usage:
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            _lock(fd)
            try:
                raw = os.pread(fd, 1 << 20, 0)
                usage = Usage.parse(raw)
                before = usage.dump()
                change(usage)
                usage.committed = max(0, usage.committed)
                data = usage.dump()
                if data != before or raw.strip() != data:
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
                return usage
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def reserve(self, make_room: Callable[[int], tuple[int, int]]) -> int:
        """`make_room(total)` gets the usage, evicts (under the lock) and returns (bytes freed,
        bytes to reserve); those are reserved for this writer. Returns the usage after."""
        def change(u: Usage) -> None:
            freed, incoming = make_room(u.total)
            u.committed -= freed
            if incoming:
                entry = u.reserved.setdefault(self.owner, [0.0, 0.0])
                entry[0] += incoming
                entry[1] = time.time()
        return self.update(change).total

    def release(self, incoming: int, kept: int) -> None:
        """This writer's write of `incoming` reserved bytes is done; `kept` of them are stored."""
        def change(u: Usage) -> None:
            entry = u.reserved.get(self.owner)
            if entry is not None:
                entry[0] -= incoming
                entry[1] = time.time()
                if entry[0] <= 0:
                    del u.reserved[self.owner]
            u.committed += kept
            u.added += kept
        self.update(change)

    def freed(self, removed: int) -> None:
        def change(u: Usage) -> None:
            u.committed -= removed
        self.update(change)

    def added(self) -> int:
        """The commit clock: take it before a scan and pass it to `reconcile` after."""
        return self.update(lambda u: None).added

    def reconcile(self, on_disk: int, added_before_scan: int) -> None:
        """After a scan that found `on_disk` bytes: those plus what writers committed while it
        ran are stored; reservations of dead writers go."""
        now = time.time()

        def change(u: Usage) -> None:
            u.committed = on_disk + max(0, u.added - added_before_scan)
            for owner in list(u.reserved):
                host, _, pid = owner.rpartition(":")
                dead = now - u.reserved[owner][1] > STALE_S
                if host == self.host and pid.isdigit() and not pid_alive(int(pid)):
                    dead = True
                if dead:
                    del u.reserved[owner]
        self.update(change)

    def total(self) -> int:
        return self.update(lambda u: None).total


def _lock(fd: int) -> None:
    """Exclusive lock; EDEADLK (the kernel's deadlock detection misjudges waits between
    processes that each hold other locks) is retried, not fatal."""
    for attempt in range(100):
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            return
        except OSError as e:
            if e.errno != errno.EDEADLK:
                raise
            time.sleep(0.001 * (attempt + 1))
    fcntl.lockf(fd, fcntl.LOCK_EX)
