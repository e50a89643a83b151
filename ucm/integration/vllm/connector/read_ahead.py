"""When a request's reads happen ahead of its step: an exact prefix read between steps
(`async_prefix_loads`, background_loads.py) and a blend request's chunk blocks read while it
waits in the queue (`prefetch_chunks`, chunk_prefetch.py). Each is on, off, or "auto": on for
SLOW_READS_HOLD_S after a worker reported a step whose reads were slow (a read ahead costs its
request a step or two, which a fast read does not repay).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ucm.integration.vllm.connector.metadata import ChunkPrefetch, UCMWorkerReport
from ucm.integration.vllm.connector.stats import UCMConnectorStats

SLOW_READS_HOLD_S = 60.0
# A blend request waits in the queue for its chunk blocks' prefetch at most this long; then its
# step reads what has not come.
PREFETCH_WAIT_S = 5.0


class ReadAhead:
    def __init__(self, async_prefix_loads: bool | str, prefetch_chunks: bool | str, num_shards: int,
                 stats: UCMConnectorStats):
        self.async_loads = async_prefix_loads
        self.prefetch_chunks = prefetch_chunks
        self.num_shards = num_shards
        self.stats = stats
        self.slow_reads_until = 0.0
        self._waiting: dict[str, list] = {}  # req_id -> [since, ranks whose prefetch ended]
        self._to_send: list[ChunkPrefetch] = []

    def _on(self, setting: bool | str) -> bool:
        return time.monotonic() < self.slow_reads_until if setting == "auto" else bool(setting)

    def prefix_between_steps(self) -> bool:
        return self._on(self.async_loads)

    def holds(self, req_id: str, prefetch: Callable[[], ChunkPrefetch]) -> bool:
        """Whether a blend request stays in the queue while the workers read its chunk blocks:
        from its first lookup (when prefetching is on) until every rank's reads ended, at most
        PREFETCH_WAIT_S; `prefetch()` names the blocks."""
        waiting = self._waiting.get(req_id)
        if waiting is None:
            if not self._on(self.prefetch_chunks):
                return False
            self._waiting[req_id] = [time.monotonic(), 0]
            self._to_send.append(prefetch())
            self.stats.add("chunk_prefetches")
            return True
        return waiting[1] < self.num_shards and time.monotonic() - waiting[0] <= PREFETCH_WAIT_S

    def take_report(self, report: UCMWorkerReport) -> None:
        for req_id, ranks in report.prefetched.items():
            if req_id in self._waiting:
                self._waiting[req_id][1] += ranks
        if report.slow_read_s:
            self.slow_reads_until = time.monotonic() + SLOW_READS_HOLD_S

    def take_prefetches(self) -> list[ChunkPrefetch]:
        """The prefetches to name in this step's metadata (each once)."""
        out, self._to_send = self._to_send, []
        return out

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
