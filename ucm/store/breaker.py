"""A circuit breaker for a mount that stops answering.

A load or dump past its deadline, or a metadata call past its own, says the mount is hung or
overloaded. Without a breaker every later request would wait out the same deadline again (a
30 s load timeout per blend step) and pin more buffers in IO that does not return. So after a
timeout the store counts as down for a back-off: lookups answer misses at once, loads and dumps
are refused at once (the requests are computed in full and nothing is stored). When the back-off
ends, the store is tried again; a timeout then doubles the back-off (up to its maximum), a call
that completes closes the breaker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    """Open (refusing) for a back-off after each `trip`; closed again by `recovered`."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic):
        if initial_s < 0 or max_s < initial_s:
            raise ValueError(f"back-off must satisfy 0 <= initial ({initial_s}) <= max ({max_s})")
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff = 0.0  # 0 while closed; else the back-off of the latest trip
        self._until = 0.0  # the clock's time the current back-off ends
        self._down_since: float | None = None
        self.trips = 0

    @property
    def enabled(self) -> bool:
        return self.initial_s > 0

    def is_open(self) -> bool:
        """Whether calls are refused now (inside a back-off)."""
        with self._lock:
            return self._backoff > 0 and self._clock() < self._until

    def is_trial(self) -> bool:
        """Tripped before and the back-off is over, not yet recovered: calls are let through to
        see whether the mount answers again."""
        with self._lock:
            return self._backoff > 0 and self._clock() >= self._until

    def remaining_s(self) -> float:
        with self._lock:
            return max(0.0, self._until - self._clock()) if self._backoff > 0 else 0.0

    def trip(self) -> float:
        """A timeout: refuse for the next back-off (doubled if the last one ended without a
        call completing since). Returns the back-off started."""
        if not self.enabled:
            return 0.0
        with self._lock:
            now = self._clock()
            if self._backoff > 0 and now < self._until:
                return self._until - now  # already open: calls that were in flight time out too
            self._backoff = self.initial_s if self._backoff == 0 else min(2 * self._backoff, self.max_s)
            self._until = now + self._backoff
            if self._down_since is None:
                self._down_since = now
            self.trips += 1
            return self._backoff

    def hold(self, seconds: float) -> None:
        """Open for at least `seconds` on another process's word (the worker that timed out)."""
        if not self.enabled or seconds <= 0:
            return
        with self._lock:
            now = self._clock()
            if self._backoff == 0:
                self.trips += 1
                self._down_since = now
            self._backoff = max(self._backoff, min(seconds, self.max_s))
            self._until = max(self._until, now + min(seconds, self.max_s))

    def recovered(self) -> float | None:
        """A call completed in time: closed. Returns how long the store was down (None if it was
        not)."""
        with self._lock:
            if self._backoff == 0:
                return None
            since = self._down_since
            self._backoff = self._until = 0.0
            self._down_since = None
            return self._clock() - since if since is not None else 0.0
