"""Exact-prefix loads that complete between steps: vLLM's asynchronous load path.

A request whose stored KV is an exact prefix alone does not need the step's forward to wait for
its reads. The scheduler answers `load_kv_async`, vLLM parks the request in
WAITING_FOR_REMOTE_KVS with its blocks allocated, and the worker reads the blocks into buffers of
its own while the other requests' steps run. Each step (`get_finished`) the finished reads are
placed into the request's blocks and the request is listed as received; vLLM schedules it from
the next step on. A block that fails, or is not read within the store's load deadline, is
reported as a load error in that same step (vLLM then computes from there), and nothing of the
request is stored afterwards. The reads land in private buffers and are placed only once
verified, so a read abandoned at its deadline never writes into blocks vLLM may have given to
another request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ucm.integration.vllm.connector.block_tensors import stored_bytes
from ucm.integration.vllm.faults import inject
from ucm.store.base import KVStoreBase, Task

# async_prefix_loads / prefetch_chunks "auto": a step whose reads waited longer than this held
# every request of its batch noticeably, so the workers report it and the scheduler reads exact
# prefixes between steps, and chunk blocks ahead of their step, for a while.
SLOW_READ_S = 0.05
# Chunk reads count as slow only below this rate too (a local directory's page cache is far faster).
SLOW_CHUNK_READ_BYTES_S = 2e9

def slow_read(wait_s: float, prefix: bool, chunks: bool, timed_out: bool, chunk_bytes: int) -> bool:
    """Whether a step's reads say reading ahead would spare the batch: exact-prefix reads alone
    (chunk reads in the same step are waited for either way), or chunk reads slow for their size."""
    return wait_s > SLOW_READ_S and ((prefix and (not chunks or timed_out))
                                     or (chunks and chunk_bytes < SLOW_CHUNK_READ_BYTES_S * wait_s))


def give_up_time(store: KVStoreBase, task: Task | None) -> float | None:
    """When a read started now is given up: the store's deadline for it (None: never)."""
    deadline = None if task is None else store.load_deadline_s(task)
    return None if not deadline else time.monotonic() + deadline


def outcome_if_ended(store: KVStoreBase, task: Task, give_up_at: float | None, now: float) -> list[bool] | None:
    """A polled read's per-block outcome once it ended or passed its give-up time (it then fails,
    counted by the store as a timeout); None while it runs."""
    if store.check(task):
        return store.wait(task)
    if give_up_at is not None and now > give_up_at:
        return store.wait(task, timeout_s=1e-3)
    return None


# Writes one block read (its buffer) into its cache slots.
Placement = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class _Load:
    task: Task | None  # None: failed before any IO (every block fails)
    buffers: list[torch.Tensor]  # one per block, [block tokens, layers, 2, heads, head size]
    slots: list[torch.Tensor]  # each block's cache slots
    block_ids: list[int]  # each block's id in vLLM's block table (reported on failure)
    give_up_at: float | None  # monotonic time past which it fails (the store's deadline); None: never


@dataclass
class Received:
    """What the loads finished since the last poll hand back to vLLM."""

    req_ids: set[str]  # listed in get_finished's received set
    failed_block_ids: set[int]  # reported as load errors in the same step
    failed_req_ids: set[str]  # requests with a failed block: nothing of them is stored
    loaded_blocks: int
    loaded_bytes: int

    def count(self, stats) -> None:
        stats.add("loaded_blocks", self.loaded_blocks)
        stats.add("load_bytes", self.loaded_bytes)
        stats.add("failed_blocks", len(self.failed_block_ids))
        stats.add("background_loads", len(self.req_ids))


class BackgroundLoads:
    """The worker's in-flight exact-prefix loads, polled once a step."""

    def __init__(self, store: KVStoreBase):
        self.store = store
        self._loads: dict[str, _Load] = {}

    def __len__(self) -> int:
        return len(self._loads)

    def start(self, req_id: str, keys: Sequence, buffers: list[torch.Tensor], slots: list[torch.Tensor],
              block_ids: list[int]) -> None:
        """Starts reading `keys` into `buffers`; a store that raises fails every block (reported at
        the next poll, so vLLM still hears of the request)."""
        try:
            inject("load")
            task = self.store.load(list(keys), [stored_bytes(b) for b in buffers])
        except Exception:  # a cache fault must not take the engine down: vLLM computes the blocks
            task = None
        self._loads[req_id] = _Load(task, buffers, slots, block_ids, give_up_time(self.store, task))

    def poll(self, place: Placement) -> Received:
        """Places every finished read (`place(buffer, slots)` per block read) and returns what
        finished: loads still running stay, unless past the deadline (then they fail)."""
        out = Received(set(), set(), set(), 0, 0)
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            ok = ([False] * len(load.buffers) if load.task is None
                  else outcome_if_ended(self.store, load.task, load.give_up_at, now))
            if ok is None:
                continue
            del self._loads[req_id]
            out.req_ids.add(req_id)
            for good, buf, slots, block_id in zip(ok, load.buffers, load.slots, load.block_ids):
                if good:
                    try:
                        place(buf, slots)
                    except Exception:  # not placed: computed by vLLM like a block that did not load
                        good = False
                if good:
                    out.loaded_blocks += 1
                    out.loaded_bytes += buf.numel() * buf.element_size()
                else:
                    out.failed_block_ids.add(block_id)
                    out.failed_req_ids.add(req_id)
        return out

    def drop(self) -> None:
        """Forgets every load (shutdown): their buffers are left to the store's abandoned tasks."""
        self._loads.clear()
