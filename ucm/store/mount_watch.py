"""Everything about a mount that may stop answering, in one place.

A hung NFS mount blocks every call into it in the kernel, where it cannot be interrupted. The
store therefore (1) runs metadata calls (stats, marker reads) on a thread of its own under a
deadline (`deadline.py`), (2) keeps loads and dumps that passed their deadline, and their pinned
buffers, until their IO returns, and (3) counts the store as down after any deadline passes
(`breaker.py`), so the next requests are answered at once instead of each waiting out its own
timeout. The store proper keeps the statistics and what a returned task means (task_outcomes.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ucm.store.base import Task
from ucm.store.breaker import Breaker
from ucm.store.deadline import DeadlineThread

logger = logging.getLogger(__name__)

# Timed-out loads and dumps keep their buffers pinned until their IO returns; past these, new
# loads and dumps are refused (as while the store is down) until some return.
ABANDONED_MAX_TASKS = 64
ABANDONED_MAX_BYTES = 2 << 30

Poll = Callable[[Task], bool]  # whether a task's IO has returned
Collect = Callable[[Task], Any]  # its outcome, once returned (releases its pins)
Returned = Callable[[Task, Any], None]  # what the store does with a timed-out task's late outcome


class MountWatch:
    def __init__(self, name: str, lookup_timeout_s: float, backoff_s: float, backoff_max_s: float,
                 poll: Poll, collect: Collect, returned: Returned, warn_once: Callable[..., None],
                 probe: Callable[[], bool] | None = None):
        self.name = name  # the store's first root, for the log
        # A cheap call into the mount (the root's marker read) that says it answers again.
        self._probe = probe
        # The store stays down because IO that timed out has not returned (a back-off ended and was
        # started again): once it returns, the mount is probed at once instead of at the back-off's end.
        self._held_by_io = False
        self.lookup_timeout_s = lookup_timeout_s
        self.breaker = Breaker(backoff_s, backoff_max_s)
        self._poll, self._collect, self._returned, self._warn_once = poll, collect, returned, warn_once
        self._lock = threading.Lock()
        self._abandoned: list[tuple[Task, int]] = []  # timed-out tasks whose IO has not returned, and their bytes
        # Lookups run on one thread of their own when they may time out; a lookup past the
        # timeout stays there until its stats return, and every lookup meanwhile is all misses.
        self._lookups = DeadlineThread("ucm-store-lookup")

    # -- metadata calls --------------------------------------------------------------------
    def metadata(self, fn: Callable[[], Any], what: str) -> Any | None:
        """`fn()` within `lookup_timeout_s`: None past it, and at once while an earlier call is
        still blocked in the file system; a timeout counts the store as down."""
        if not self.lookup_timeout_s:
            return fn()
        call = self._lookups.run(fn, self.lookup_timeout_s)
        if call is not None:
            return call.result()
        self._warn_once(("lookup timeout",), "store %s not answered after lookup_timeout_s=%g s (hung or "
                        "overloaded mount?); it, and every lookup until it returns, count as misses (computed "
                        "in full); further timeouts are only counted in stats().lookup_timeouts", what,
                        self.lookup_timeout_s)
        self.trip(what)
        return None

    # -- down or up ------------------------------------------------------------------------
    def down(self) -> bool:
        """Whether the store counts as down now. At the end of a back-off the store is tried
        again only if the IO that timed out has returned: until the mount answers it, it is down.
        When that IO returns during a back-off it started again (a hang released), the mount is
        probed at once and the store is up again if it answers, without waiting the back-off out."""
        if self.breaker.is_open():
            if self._held_by_io and not self._io_blocked():
                self._held_by_io = False
                if self._probe is not None and self.metadata(self._probe, "probe after a hang") is True:
                    self.answered()
                    return False
            return True
        if self.breaker.is_trial() and self._io_blocked():
            self._held_by_io = True
            self.breaker.trip()
            return True
        return False

    def down_for_s(self) -> float:
        return self.breaker.remaining_s() if self.down() else 0.0

    def refusing_io(self) -> bool:
        """Down, or too many timed-out tasks still pin their buffers: no new loads or dumps."""
        if self.down():
            return True
        self.reap()
        with self._lock:
            tasks = len(self._abandoned)
            pinned = sum(n for _, n in self._abandoned)
        if tasks < ABANDONED_MAX_TASKS and pinned < ABANDONED_MAX_BYTES:
            return False
        self._warn_once(("abandoned cap",), "%d timed-out store tasks still hold %d MiB in IO that has not "
                        "returned; new loads and dumps are refused until some return (counted in "
                        "stats().down_refusals)", tasks, pinned >> 20)
        return True

    def trip(self, what: str) -> None:
        """A deadline passed: the store counts as down for a back-off (breaker.py)."""
        first = not (self.breaker.is_open() or self.breaker.is_trial())
        backoff = self.breaker.trip()
        if first and backoff:
            logger.warning("store %s: %s past its deadline; the store counts as down for %g s (lookups miss, "
                           "loads and dumps are refused: requests are computed in full), then is tried again "
                           "once the IO that timed out returns; refusals are counted in stats().down_refusals",
                           self.name, what, backoff)

    def answered(self) -> None:
        """A load or dump completed within its deadline (or the probe after a hang answered)."""
        self._held_by_io = False
        down_s = self.breaker.recovered()
        if down_s is not None:
            logger.warning("store %s answers again after %.0f s down", self.name, down_s)

    # -- timed-out tasks -------------------------------------------------------------------
    def abandon(self, task: Task, pinned_bytes: int, what: str) -> None:
        """A task past its deadline: kept (its buffers pinned) until its IO returns."""
        self.trip(what)
        with self._lock:
            self._abandoned.append((task, pinned_bytes))

    def reap(self) -> None:
        """Hands the timed-out tasks whose IO has returned since, with their outcomes, to the
        store (their buffers are released now)."""
        with self._lock:
            still, returned = [], []
            for task, nbytes in self._abandoned:
                if self._poll(task):
                    returned.append((task, self._collect(task)))
                else:
                    still.append((task, nbytes))
            self._abandoned = still
        for task, outcome in returned:
            self._returned(task, outcome)

    def count(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(kind is None or t.kind == kind for t, _ in self._abandoned)

    @property
    def lookup_hung(self) -> bool:
        return self._lookups.hung

    def close(self) -> None:
        self._lookups.close()  # the lookup thread ends after its current call

    def _io_blocked(self) -> bool:
        self.reap()
        return self.count() > 0 or self._lookups.hung
