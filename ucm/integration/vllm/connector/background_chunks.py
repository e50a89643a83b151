"""Chunks a request missed, waiting to be computed alone while the engine is idle.

Under the "alone" chunk-store policy a chunk is stored only as computed with nothing before it, so
organic traffic (no indexing requests) would never store the documents that follow a system
prompt. The connector's scheduler half queues each missed chunk of a finished request here;
BlendFirstScheduler sends the queue's head as a request of its own (the chunk's tokens, the
request's tenant and adapter, one output token) whenever no user request is waiting or running,
and stops it when one arrives. Computed alone, the chunk is stored by the usual exact-prefix
dumps, under the keys later requests look its blocks up by.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Chunks queued at most; a missed chunk beyond it is dropped (background_chunks_dropped).
QUEUE_LIMIT = 256


@dataclass(frozen=True)
class BackgroundChunk:
    token_ids: tuple[int, ...]
    last_hash: bytes  # its last block's hash: once that block is stored, nothing is left to compute
    lora_request: Any = None  # the adapter and tenant of the request that missed it
    cache_salt: str | None = None
    block_hasher: Callable | None = None  # vLLM's, from that request: the same block hashes
    kv_transfer_params: dict | None = None  # its chunk length, where that request gave lengths


class BackgroundChunks:
    """A bounded FIFO of missed chunks, each queued once (by its last block's hash)."""

    def __init__(self, limit: int = QUEUE_LIMIT):
        self.limit = limit
        self._queue: deque[BackgroundChunk] = deque()
        self._keys: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, chunk: BackgroundChunk) -> bool | None:
        """Queues a chunk: True; False when the queue is full (dropped); None when already queued."""
        if chunk.last_hash in self._keys:
            return None
        if len(self._queue) >= self.limit:
            return False
        self._queue.append(chunk)
        self._keys.add(chunk.last_hash)
        return True

    def take(self) -> BackgroundChunk | None:
        if not self._queue:
            return None
        chunk = self._queue.popleft()
        self._keys.discard(chunk.last_hash)
        return chunk

    def put_back(self, chunk: BackgroundChunk) -> None:
        """A chunk stopped before it was computed goes first next time (even past the limit)."""
        if chunk.last_hash not in self._keys:
            self._queue.appendleft(chunk)
            self._keys.add(chunk.last_hash)
