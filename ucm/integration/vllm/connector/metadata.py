"""What the scheduler-side connector tells the worker-side connector each step.

Plain picklable types only: the metadata crosses a process boundary every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ucm.config import QUERY_SELECTION
from ucm.store.keys import StoreKey


@dataclass
class BlockLoad:
    """A stored block written token by token at prompt positions [start + skip, start + num_tokens).

    `rope_delta` rotates K from the block's stored positions to its place in this prompt. A block
    of `stored_tokens` rows (0: `num_tokens`) of which only rows from `rows_from` on are wanted
    (a chunk block read through a reference to exact blocks) gives rows
    [rows_from + skip, rows_from + num_tokens).
    """

    key: StoreKey
    start: int
    num_tokens: int
    rope_delta: int = 0
    skip: int = 0
    rows_from: int = 0
    stored_tokens: int = 0

    @property
    def stored_rows(self) -> int:
        return self.stored_tokens or self.num_tokens

    @property
    def whole(self) -> bool:
        """Every stored row is written, in order: the block can be read straight into place."""
        return self.skip == 0 and self.rows_from == 0 and self.stored_rows == self.num_tokens

    @property
    def rows(self) -> slice:
        return slice(self.rows_from + self.skip, self.rows_from + self.num_tokens)


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
    kv_shift_sample: float = 0.0  # share of each loaded chunk's tokens, evenly spaced, that estimate the shift

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
    # Its prefix_loads complete between steps (vLLM's WAITING_FOR_REMOTE_KVS): nothing is scheduled
    # for it until the worker lists it as received.
    load_async: bool = False

    @property
    def blending(self) -> bool:
        return self.blend is not None


@dataclass
class ChunkPrefetch:
    """A blend request held in the queue while the workers read its chunk blocks (keys, rows
    stored per block) into buffers of their own; its Blend step then takes them from there."""

    req_id: str
    keys: list[StoreKey]
    rows: list[int]


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestStep] = field(default_factory=list)
    prefetches: list[ChunkPrefetch] = field(default_factory=list)


@dataclass
class UCMWorkerReport(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step; vLLM sums the reports of all ranks.

    A dump counts as stored only once every rank confirmed its shard (`stored` counts ranks per
    key); until then the scheduler does not serve it to anyone. Requests whose loads failed, or
    whose Blend region the forward did not run, dump nothing more and report a fallback.
    """

    stored: dict[StoreKey, int] = field(default_factory=dict)  # dump key -> ranks that stored their shard
    not_stored: set[StoreKey] = field(default_factory=set)  # refused, failed or timed out on some rank
    load_failed: set[str] = field(default_factory=set)  # request ids with a failed or timed-out load
    not_blended: set[str] = field(default_factory=set)  # request ids whose Blend region was not run
    blend_error: set[str] = field(default_factory=set)  # request ids handed back to vLLM after a fault
    # Seconds the store still counts as down on some rank (a load or dump passed its deadline):
    # the scheduler's lookups, which a mount that answers stats but not reads still answers, miss.
    store_down_s: float = 0.0
    # A step's reads waited this long on some rank, over SLOW_READ_S (0: none did; chunk reads
    # count only when slow for their size): under async_prefix_loads / prefetch_chunks "auto" the
    # scheduler reads exact prefixes between steps and chunk blocks ahead of their step for a while.
    slow_read_s: float = 0.0
    prefetched: dict[str, int] = field(default_factory=dict)  # request id -> ranks whose chunk prefetch ended

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UCMWorkerReport:
        assert isinstance(other, UCMWorkerReport)
        return UCMWorkerReport(_summed(self.stored, other.stored), self.not_stored | other.not_stored,
                               self.load_failed | other.load_failed, self.not_blended | other.not_blended,
                               self.blend_error | other.blend_error, max(self.store_down_s, other.store_down_s),
                               max(self.slow_read_s, other.slow_read_s),
                               _summed(self.prefetched, other.prefetched))

    def is_empty(self) -> bool:
        return not (self.stored or self.not_stored or self.load_failed or self.not_blended or self.blend_error
                    or self.store_down_s or self.slow_read_s or self.prefetched)


def _summed(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, n in b.items():
        out[key] = out.get(key, 0) + n
    return out
