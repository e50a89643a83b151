"""Background directory scans of the file store.

A scan removes temp files left by crashed writers and, for a capacity-limited store, refreshes
the usage it tracks (other processes' writes and evictions) and evicts back under the limit. It
runs off the caller's path because walking a large NFS tree takes seconds to minutes: every
`usage_rescan_s` with a capacity limit, every `temp_grace_s` without, and at once when a writer
finds the store full of files it has not seen.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ucm.store.capacity import CapacityLimiter
from ucm.store.layout import BlockLayout, ScannedFile, TempOwner
from ucm.store.liveness import pid_alive

logger = logging.getLogger(__name__)


def is_stale_temp(owner: TempOwner, mtime: float, now: float, host: str, grace_s: float) -> bool:
    """A temp file is abandoned if its writer (same host) is dead, or it is older than the grace.

    The age rule also covers reused pids and other hosts; removing the temp file of a writer
    that is merely slow only makes that writer's dump report False.
    """
    if now - mtime > grace_s:
        return True
    return owner.host == host and not pid_alive(owner.pid)


class Housekeeper:
    def __init__(self, layout: BlockLayout, limiter: CapacityLimiter | None, temp_grace_s: float, rescan_s: float):
        self._layout = layout
        self._limiter = limiter
        self._temp_grace_s = temp_grace_s
        self._rescan_s = rescan_s
        self._scan_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a scan asked for now (request_scan)
        self.first_scan_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucm-store-housekeeping", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request_scan(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def scan_once(self) -> int:
        """One full scan; returns how many abandoned temp files were removed."""
        with self._scan_lock:
            now = time.time()
            mark = self._limiter.scan_mark() if self._limiter is not None else None
            removed = 0
            blocks: list[ScannedFile] = []
            for f, owner in self._layout.scan():
                if self._stop.is_set():
                    return removed
                if owner is None:
                    blocks.append(f)
                elif is_stale_temp(owner, f.mtime, now, self._layout.host, self._temp_grace_s):
                    try:
                        os.unlink(f.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        logger.warning("cannot remove abandoned temp file %s: %s", f.path, e)
            if removed:
                logger.info("removed %d abandoned temp files under %s", removed, ", ".join(self._layout.backends))
            if self._limiter is not None:
                self._limiter.reset_from_scan(blocks, scan_started=now, mark=mark)
            return removed

    def _run(self) -> None:
        try:
            self.scan_once()
        except Exception:  # a failed scan must not take the store down
            logger.exception("store directory scan failed")
        finally:
            self.first_scan_done.set()
        # Without a capacity limit scans only clean up temp files of writers that died, so they
        # run once per grace period; rescan_s <= 0: only when asked for.
        interval = self._rescan_s if self._limiter is not None else self._temp_grace_s
        while not self._stop.is_set():
            self._wake.wait(interval if interval > 0 else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.scan_once()
            except Exception:
                logger.exception("store directory rescan failed")
