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
from typing import TYPE_CHECKING, Any

from ucm.config import CHUNK_LENGTHS_PARAM

if TYPE_CHECKING:
    from ucm.integration.vllm.connector.request_state import RequestState

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


def missed_chunks(state: RequestState, by_lengths: bool) -> list[BackgroundChunk]:
    """Every chunk after the prompt's first with a block the store did not have and whose segment
    is admitted (a first sighting is computed alone only when it comes again). `by_lengths`: the
    request gave chunk lengths, so alone the chunk is given its length the same way."""
    request, plan = state.request, state.plan
    blocks: dict[int, list] = {}
    for blk in plan.blocks:
        blocks.setdefault(blk.chunk_start, []).append(blk)
    tokens = request.prompt_token_ids
    out = []
    for span in plan.layout.chunks[1:]:
        chunk_blocks = blocks.get(span.start)
        if not chunk_blocks or all(b.hit for b in chunk_blocks):
            continue
        if state.admission and not state.admission.admits(span):
            continue
        last = max(chunk_blocks, key=lambda b: b.tokens.end)
        out.append(BackgroundChunk(
            tuple(tokens[span.start:span.end]), last.block_hash,
            getattr(request, "lora_request", None), getattr(request, "cache_salt", None),
            getattr(request, "_block_hasher", None),
            {CHUNK_LENGTHS_PARAM: [len(span)]} if by_lengths else None))
    return out
