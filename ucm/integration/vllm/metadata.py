"""What the scheduler-side connector tells the worker-side connector each step.

Plain picklable types only: the metadata crosses a process boundary every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm.config import QUERY_SELECTION


@dataclass
class BlockLoad:
    """A stored block written token by token at prompt positions [start + skip, start + num_tokens).

    `rope_delta` rotates K from the block's stored positions to its place in this prompt.
    """

    key: bytes
    start: int
    num_tokens: int
    rope_delta: int = 0
    skip: int = 0


@dataclass
class BlockDump:
    """Prompt positions [start, start + num_tokens) stored under `key`, K rotated by -rope_delta."""

    key: bytes
    start: int
    num_tokens: int
    rope_delta: int = 0


@dataclass
class RequestStep:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int  # tokens with KV before this step (local + external hits)
    num_scheduled_tokens: int
    prefix_loads: list[BlockLoad] = field(default_factory=list)  # external exact hits (not scheduled)
    chunk_loads: list[BlockLoad] = field(default_factory=list)  # chunk KV under scheduled tokens
    dumps: list[BlockDump] = field(default_factory=list)
    ratio: float = 0.0  # share of the loaded tokens recomputed from the check layer on (config or per-request override)
    selection: str = QUERY_SELECTION  # how the recomputed share is ranked (config or per-request override)

    @property
    def blending(self) -> bool:
        return bool(self.chunk_loads)


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestStep] = field(default_factory=list)
