"""What the scheduler-side connector tells the worker-side connector each step.

Plain picklable types only: the metadata crosses a process boundary every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm.config import QUERY_SELECTION
from ucm.store.keys import StoreKey


@dataclass
class BlockLoad:
    """A stored block written token by token at prompt positions [start + skip, start + num_tokens).

    `rope_delta` rotates K from the block's stored positions to its place in this prompt.
    """

    key: StoreKey
    start: int
    num_tokens: int
    rope_delta: int = 0
    skip: int = 0


@dataclass
class BlockDump:
    """Prompt positions [start, start + num_tokens) stored under `key`, K rotated by -rope_delta."""

    key: StoreKey
    start: int
    num_tokens: int
    rope_delta: int = 0


@dataclass
class BlendRegion:
    """One request's Blend hand-off: prompt positions [start, end) that vLLM counts as computed
    (reported as external tokens, so the scheduler charges only the rest) and the Blend forward
    fills: loaded rows keep their KV or are recomputed from the check layer on, rows without
    loaded KV (cache misses, failed loads) run every layer. Per request, never per token."""

    start: int
    token_ids: list[int]  # the prompt's tokens at [start, end): the forward embeds the rows it runs
    ratio: float  # share of the loaded tokens recomputed from the check layer on
    selection: str = QUERY_SELECTION  # how that share is ranked
    question_end: int = 0  # probe queries come from rows before this position (the prompt's end)
    chunk_starts: list[int] = field(default_factory=list)  # prompt positions where its loaded chunks start
    chunk_start_tokens: int = 0  # recomputed at the start of every loaded chunk before any ranking
    kv_shift: float = 0.0  # share of its chunk's mean error the KV not recomputed is moved by (blend/kv_shift.py)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class RequestStep:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int  # tokens with KV before this step (local + external hits)
    num_scheduled_tokens: int
    prefix_loads: list[BlockLoad] = field(default_factory=list)  # external exact hits (not scheduled)
    chunk_loads: list[BlockLoad] = field(default_factory=list)  # chunk KV inside `blend`'s region
    dumps: list[BlockDump] = field(default_factory=list)
    blend: BlendRegion | None = None  # the step that blends this request (its first)

    @property
    def blending(self) -> bool:
        return self.blend is not None


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestStep] = field(default_factory=list)
