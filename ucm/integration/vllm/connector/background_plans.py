"""Plans made off the scheduler's step (`async_lookups`).

A request's plan asks the store a few rounds of questions in series (its exact prefix, its chunks'
blocks, references, sightings). On a slow mount they take a good part of a second, and made in
vLLM's `get_num_new_matched_tokens` they hold the step of every running request meanwhile. When
lookups are slow and other requests are running, a new request's plan is made on a thread of its
own while the request waits in the queue (vLLM skips it: `(None, False)`), and taken at a later
step. An idle engine plans in its own step, as before: nobody else would wait.

Plans never run two at a time (one lock): what a plan reads of the scheduler's bookkeeping is
safe to read while the scheduler's thread changes it (the store view, counters), but two plans
would share the view's per-plan state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ucm.integration.vllm.connector.stats import UCMConnectorStats

T = TypeVar("T")

# "auto": plans move off the step for SLOW_LOOKUPS_HOLD_S after a plan whose lookups took longer
# than SLOW_LOOKUPS_S (a request planned later starts a step later, which a fast lookup does not repay).
SLOW_LOOKUPS_S = 0.05
SLOW_LOOKUPS_HOLD_S = 60.0


class BackgroundPlans:
    def __init__(self, setting: bool | str, asked_seconds: Callable[[], float], stats: UCMConnectorStats):
        self.setting = setting
        self._asked_seconds = asked_seconds  # the store view's lookup time so far
        self.stats = stats
        self.slow_until = 0.0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # (req_id, computed tokens it is planned at) -> job: BlendFirstScheduler's look-ahead plans
        # at 0, vLLM's question after its local prefix hit; each keeps its own.
        self._jobs: dict[tuple[str, int], Future] = {}

    def wanted(self) -> bool:
        """Whether a new request's plan should be made off the step (when others are running)."""
        if self.setting == "auto":
            return time.monotonic() < self.slow_until
        return bool(self.setting)

    def off_step(self, req_id: str, others_run: bool) -> bool:
        """Whether a request's plan is made off the step (`later`): it is being made there
        already, or lookups are slow and other requests run meanwhile."""
        return any(key[0] == req_id for key in self._jobs) or (others_run and self.wanted())

    def now(self, plan: Callable[[], T]) -> T:
        """`plan()` made in the caller's thread, after any plan in flight on the planner's."""
        with self._lock:
            start = self._asked_seconds()
            try:
                return plan()
            finally:
                if self._asked_seconds() - start > SLOW_LOOKUPS_S:
                    self.slow_until = time.monotonic() + SLOW_LOOKUPS_HOLD_S

    def later(self, req_id: str, num_computed_tokens: int, plan: Callable[[], T | None],
              max_age_s: float) -> T | None:
        """The plan made on the planner's thread once it is there (None until then): started at
        the first call, and again when the plan is older than `max_age_s` (stores change) or came
        back empty (waiting for dumps). Raises what the plan raised."""
        key = (req_id, num_computed_tokens)
        job = self._jobs.get(key)
        if job is not None:
            if not job.done():
                return None
            del self._jobs[key]
            state, finished = job.result()
            if state is not None and time.monotonic() - finished <= max_age_s:
                return state
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ucm-plan")
        self._jobs[key] = self._pool.submit(lambda: (self.now(plan), time.monotonic()))
        self.stats.add("background_plans")
        return None

    def forget(self, req_id: str) -> None:
        """The request ended: its plan, if one is being made, is dropped when done."""
        for key in [k for k in self._jobs if k[0] == req_id]:
            del self._jobs[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
