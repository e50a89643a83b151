"""The interface every KV block store implements, and the value types it returns.

A store maps fixed-size key digests to opaque byte blocks. It must never hand back wrong
bytes: anything that cannot be verified is reported as a per-key failure (False), not raised.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64

# Anything exposing a C-contiguous buffer: numpy array, bytearray, memoryview, tensor.numpy().
Buffer = Any


@dataclass
class StoreStats:
    """Counters since the store was opened (a snapshot; mutating it changes nothing).

    load_errors / dump_errors count every key whose load / dump returned False;
    checksum_errors counts the subset of load errors where a stored block was corrupt
    (bad header, truncated, checksum mismatch).
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    dump_blocks: int = 0
    dump_bytes: int = 0
    dump_seconds: float = 0.0
    load_errors: int = 0
    dump_errors: int = 0
    checksum_errors: int = 0
    evictions: int = 0
    dram_hits: int = 0  # loads served by the DRAM tier (included in load_blocks)
    dump_skipped: int = 0  # dumps of blocks that were already stored (included in dump_blocks)
    load_timeouts: int = 0  # keys of loads abandoned after the store's timeout (included in load_errors)
    # keys of dumps whose caller stopped waiting after the store's timeout (their IO is accounted,
    # in dump_blocks / dump_errors, when it returns)
    dump_timeouts: int = 0
    dump_over_capacity: int = 0  # blocks of a dump that did not fit under capacity_gb (not stored; in dump_errors)
    # keys answered as misses because the store's lookup passed its timeout (or one still had)
    lookup_timeouts: int = 0
    # keys of dumps refused because the usage ledger (capacity_gb) did not answer within
    # lookup_timeout_s (or an earlier call to it still had not): nothing written, in dump_errors
    ledger_timeouts: int = 0
    quarantined: int = 0  # blocks whose read failed with an IO error: misses in this process for a while
    down_trips: int = 0  # times the store was counted as down after a deadline passed (breaker.py)
    # keys looked up, loaded or dumped without IO while the store counted as down (misses;
    # load and dump refusals are also in load_errors / dump_errors)
    down_refusals: int = 0

    def count_lookup(self, found: Sequence[bool]) -> None:
        hits = sum(found)
        self.lookups += len(found)
        self.hits += hits
        self.misses += len(found) - hits

    def copy(self) -> StoreStats:
        return dataclasses.replace(self)


@dataclass(frozen=True)
class BlockMeta:
    """What a stored block says about itself, without reading the payload."""

    payload_len: int
    token_count: int


@dataclass(eq=False)
class Task:
    """Handle of an asynchronous load or dump; pass it to `wait` / `check` of its store."""

    kind: str  # "load" or "dump"
    keys: list[bytes]
    # Store-private state. `results` is set by the first `wait` (later waits return it again).
    results: list[bool] | None = None
    native_id: int | None = None  # the native engine's task
    native_indices: list[int] = field(default_factory=list)  # positions of its keys in `keys`
    served_from_dram: set[int] = field(default_factory=set)  # positions finished at submit time
    # A load given up on after the store's timeout: IO threads may still write its destinations,
    # so the caller must not reuse them for anything else.
    timed_out: bool = False
    refused: bool = False  # answered without IO: the store counted as down (its native keys are misses)
    context: Any = None


class KVStoreBase(ABC):
    """Shared KV block store. Thread-safe; loads and dumps are asynchronous."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored; answers every key (a miss does not cut later hits)."""

    def lookup_shards(self, keys: Sequence[bytes], num_shards: int) -> list[bool]:
        """Whether every shard of each key is stored (`keys.shard_key`; one lookup for all of them):
        a block split over writers is usable only whole."""
        from ucm.store.keys import shard_key

        found = self.lookup([shard_key(k, r, num_shards) for k in keys for r in range(num_shards)])
        return [all(found[i * num_shards:(i + 1) * num_shards]) for i in range(len(keys))]

    @abstractmethod
    def load(self, keys: Sequence[bytes], destinations: Sequence[Buffer]) -> Task:
        """Start copying blocks into destinations (one buffer per key, exactly the block length).

        Destinations must stay alive and untouched until `wait`. Where `wait` reports False the
        destination's contents are unspecified (it may be partly overwritten): recompute it.
        """

    def load_segments(self, keys: Sequence[bytes], destinations: Sequence[Sequence[Buffer]], first: int,
                      total: int) -> Task:
        """Start copying segments `first, first + 1, ...` of blocks stored as `total` equal segments
        (`dump(..., segments=total)`), the j-th of block i into `destinations[i][j]`, each verified
        alone. A block stored otherwise fails (left stored); the caller reads it whole instead."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a part of a block")

    @abstractmethod
    def dump(self, keys: Sequence[bytes], sources: Sequence[Buffer], token_counts: Sequence[int],
             segments: int = 1) -> Task:
        """Start storing blocks. Sources must stay unmodified until `wait` returns. `segments` > 1:
        each source is that many equal segments, each checksummed apart (`load_segments`)."""

    @abstractmethod
    def wait(self, task: Task, timeout_s: float | None = None) -> list[bool]:
        """Block until the task is done; per key: load -> verified bytes are in the destination,
        dump -> the block is stored (now or already before). A store with deadlines gives up after
        `timeout_s` (None: its own for the kind of task) and reports the task's keys as failed."""

    def load_deadline_s(self, task: Task) -> float | None:
        """How long `wait` gives this load (None: no deadline): callers that poll a load rather
        than wait for it give up at the same point."""
        return None

    @property
    def metadata_timeout_s(self) -> float | None:
        """The deadline of metadata calls (lookups); for small reads a caller must not stall on
        (the scheduler's chunk reference records). None: no deadline."""
        return None

    @abstractmethod
    def check(self, task: Task) -> bool:
        """Whether the task is finished, without blocking."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Snapshot of the counters."""

    @abstractmethod
    def close(self) -> None:
        """Finish in-flight work and release resources; idempotent."""

    def down_for_s(self) -> float:
        """Seconds the store still counts as down after a deadline passed (0: it answers)."""
        return 0.0

    def hold_down(self, seconds: float) -> None:
        """Count the store as down for `seconds` on another process's word (a store without
        deadlines ignores it)."""

    def __enter__(self) -> KVStoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def validate_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys are digests of MIN..MAX_KEY_BYTES bytes; anything else is a caller bug."""
    out = list(keys)
    for i, key in enumerate(out):
        if not isinstance(key, bytes) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(
                f"key {i} must be bytes of {MIN_KEY_BYTES}..{MAX_KEY_BYTES} length, "
                f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
            )
    return out


def byte_view(buf: Buffer, writable: bool = False) -> memoryview:
    """Flat byte view of a C-contiguous buffer (the form copies and hashes use)."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
