"""File-system calls with a deadline: a hung mount must not stall vLLM's worker.

A call into a hung NFS mount (a stat, an `fcntl` lock) blocks in the kernel and cannot be
interrupted. So such calls run, in order, on one daemon thread of their own, and the caller waits
at most its deadline. A call past it stays on that thread until the file system answers; until
then the thread counts as hung and later calls are answered at once as "not done" instead of
each waiting out its own deadline behind it (the ones that must still happen, such as returning
a reservation, are queued and run when it answers).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Call:
    """One call handed to the thread: `value` or `error` is set before `done`."""

    __slots__ = ("fn", "value", "error", "done")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def result(self) -> Any:
        """The call's value; re-raises its exception in the caller."""
        if self.error is not None:
            raise self.error
        return self.value


class DeadlineThread:
    """Runs calls in order on one daemon thread (started at the first call); see the module."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue[Call | None] | None = None
        self._hung: Call | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def hung(self) -> bool:
        """A call that missed its deadline has not returned yet."""
        with self._lock:
            return self._hung is not None and not self._hung.done.is_set()

    def run(self, fn: Callable[[], Any], timeout_s: float, queue_when_hung: bool = False) -> Call | None:
        """Runs `fn()` on the thread and waits up to `timeout_s`; returns the finished call (its
        `result()` gives the value or raises), or None when it missed the deadline (it still runs
        and finishes later) or the thread is hung (then `fn` runs later only if `queue_when_hung`)."""
        call = Call(fn)
        with self._lock:
            if self._hung is not None:
                if not self._hung.done.is_set():
                    if queue_when_hung and not self._closed:
                        self._jobs.put(call)
                    return None
                self._hung = None
                logger.warning("%s answers again: the call past its deadline returned", self.name)
            closed = self._closed
            if not closed:
                if self._jobs is None:
                    # A daemon thread: one blocked in a hung mount must not keep the process from exiting.
                    self._jobs = queue.SimpleQueue()
                    threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True).start()
                self._jobs.put(call)
        if closed:  # no thread any more: the caller's own, without a deadline
            _serve_one(call)
            return call
        if call.done.wait(timeout_s):
            return call
        with self._lock:
            if self._hung is None or self._hung.done.is_set():
                self._hung = call
        return None

    def close(self) -> None:
        """The thread ends after the calls queued so far (at once when none blocks); later calls
        run in the caller, without a deadline, or not at all while one is still blocked."""
        with self._lock:
            self._closed = True
            if self._jobs is not None:
                self._jobs.put(None)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (call := jobs.get()) is not None:
        _serve_one(call)


def _serve_one(call: Call) -> None:
    try:
        call.value = call.fn()
    except BaseException as e:  # re-raised in the caller by result()
        call.error = e
    call.done.set()
