"""The store's byte usage, shared by every process on the directory through one locked file.

Each process used to count its own writes between rescans, so N writers could fill N times the
limit. The ledger (`<first backend>/.ucm-usage`, one decimal number) is read and updated under
an exclusive `fcntl` lock, which NFS (v4, or v3 with lockd) serialises across hosts: a writer
adds its block's size *before* writing it (a reservation), takes it back if the block turned out
to exist or the write failed, and an evicting process subtracts what it unlinked. Rescans set
it to the bytes found on disk plus this process's writes in flight. Drift (a writer killed
between reservation and release, another process's writes in flight during a rescan) lasts until
the next rescan; the limit then holds to within the blocks in flight per process.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

LEDGER_NAME = ".ucm-usage"


class UsageLedger:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, LEDGER_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        os.close(fd)

    def update(self, change: Callable[[int], int]) -> int:
        """Under the lock: read the usage, `change(usage)` -> new usage, write it; returns it."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, 64, 0).strip()
                used = int(raw) if raw.isdigit() else 0
                new = max(0, int(change(used)))
                if new != used:
                    data = str(new).encode()
                    os.pwrite(fd, data.ljust(max(len(raw), len(data))), 0)
                return new
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def add(self, delta: int) -> int:
        return self.update(lambda used: used + delta)

    def read(self) -> int:
        return self.update(lambda used: used)
