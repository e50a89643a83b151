"""Scheduler half of the UCM connector: lookup, load plan, dump plan, prefix-cache hygiene.

One lookup serves both caches: vLLM's local prefix cache has already matched the leading blocks;
the store is asked for the next exact prefix blocks, then for every chunk block behind them.
Both are reported to vLLM as external tokens: the exact prefix, and the Blend region from there
to the prompt's last token. vLLM schedules and charges that one token, so a blend request fits
any step budget and chunked prefill and its question is never split off the blend; the Blend
forward runs the rows it needs from the region (misses, the question, the recomputed share)
beside the scheduled row, under a per-step cap of its own (docs/serving.md).

This module answers vLLM's scheduler-side connector calls and admits blend requests under the step
cap; the parts live beside it: `store_view` (lookups, dumps awaiting confirmation, records the
scheduler writes), `request_lookup` (a request looked up and planned), `request_state` (a
request's lifecycle and report), `request_plan` (chunks, region, loads), `dump_plan` (what is
stored after a step), `approximate_hashes` (prefix-cache hygiene), `background_chunks` (missed
chunks computed alone), `read_ahead` (reads done ahead of a request's step).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ucm.config import CHUNK_LENGTHS_PARAM
from ucm.integration.vllm.connector.adapter_identity import AdapterDigests
from ucm.integration.vllm.connector.approximate_hashes import ApproximateHashes
from ucm.integration.vllm.connector.background_chunks import BackgroundChunks, missed_chunks
from ucm.integration.vllm.connector.dump_plan import new_dumps
from ucm.integration.vllm.connector.metadata import (BlockDump, BlockLoad, RequestStep, UCMConnectorMetadata,
                                                    UCMWorkerReport)
from ucm.integration.vllm.connector.read_ahead import ReadAhead
from ucm.integration.vllm.connector.request_params import RequestParamPolicy
from ucm.integration.vllm.connector.request_lookup import RequestLookup
from ucm.integration.vllm.connector.request_plan import STAGED_PER_ROW, chunk_prefetch, first_blend_step
from ucm.integration.vllm.connector.request_state import Phase, RequestState, count_only_reused_as_cached
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.connector.store_view import KeySpace, StoreView
from ucm.integration.vllm.faults import ErrorLog, inject
from ucm.sparse.blend.hashing import BlockHasher
from ucm.store.keys import KeyKind

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ucm.config import UCMConfig
    from ucm.store.base import KVStoreBase

logger = logging.getLogger(__name__)

# A plan held for a waiting request (deferred at the step cap, or planned ahead by
# BlendFirstScheduler) is used for this long; then it is made again: chunks stored since count.
HELD_PLAN_SECONDS = 2.0
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
# A worker whose store is down says so in every step's report; the scheduler's store follows it
# for at most this long per report, so it is up again soon after the worker's is (the worker's
# back-off can be a minute, and it may end early when a hung mount answers again).
STORE_DOWN_HOLD_S = 5.0


class SchedulerSide:
    def __init__(self, config: UCMConfig, store: KVStoreBase, namespace: bytes, block_size: int, hash_algo: str,
                 step_budget: int = 8192, num_shards: int = 1, kv_role: str = "kv_both"):
        self.blend = config.sparse
        # vLLM's kv_role: a producer stores and never loads (nor blends), a consumer loads and never stores.
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)} for the UCM "
                             f"connector, got {kv_role!r}")
        self.loads = kv_role != "kv_producer"
        self.stores = kv_role != "kv_consumer"
        # Rows the Blend forward may run beside vLLM's scheduled ones in one step.
        self.step_cap = self.blend.step_cap(step_budget) if self.blend else 0
        # Blend rows admitted per step: the cap, lowered by BlendFirstScheduler for its short steps
        # (a region is still planned, and cut, against step_cap).
        self.admit_cap = self.step_cap
        # Blend work above which a blend request waits this step (BlendFirstScheduler's held steps).
        self.hold_over: int | None = None
        self._step_work = 0  # committed this step (admitted blend requests)
        self._step_staged = 0  # loaded tokens staged this step (admitted blend requests)
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._hasher: BlockHasher | None = None
        self._states: dict[str, RequestState] = {}
        self.hashes = ApproximateHashes()  # blended blocks' hashes, salted
        self._resumed: dict[str, tuple[int, int]] = {}  # preempted blend requests: (preemptions, dumped)
        self._deferred: dict[str, tuple[int, RequestState]] = {}  # deferred at the cap: (computed, plan)
        self._loads_to_start: list[RequestState] = []  # allocated this step, their exact prefix read between steps
        self.stats = UCMConnectorStats()  # this interval's counts, taken by vLLM after every step
        self.view = StoreView(store, namespace, block_size, num_shards, self.stats)
        self.reads = ReadAhead(config.async_prefix_loads, config.prefetch_chunks, num_shards, self.stats)
        self.adapters = AdapterDigests()  # LoRA adapters' content digests, for their requests' keys
        self._errors = ErrorLog(logger)
        self.params = RequestParamPolicy(self.blend)
        self.lookup = RequestLookup(self.blend, self.view, self.hashes, lambda: self.hasher, self.params, self.stats,
                                    block_size, self.step_cap, self.loads, self.stores)
        # Missed chunks to compute alone while idle (BlendFirstScheduler takes them); None: off.
        self.background = (BackgroundChunks() if self.blend and self.blend.computes_missed_chunks_alone
                           and self.stores else None)

    @property
    def store(self) -> KVStoreBase:
        return self.view.store

    @property
    def hasher(self) -> BlockHasher:
        # vLLM initialises NONE_HASH when the engine core starts, after connectors may be built;
        # take it from vLLM itself so chunk hashes share the prefix cache's hash space exactly.
        if self._hasher is None:
            from vllm.v1.core import kv_cache_utils

            self._hasher = BlockHasher(self.hash_algo, self.block_size, kv_cache_utils.NONE_HASH)
        return self._hasher

    def keys_for(self, lora_request: LoRARequest | None) -> KeySpace | None:
        """The key space of a request's store keys, the one place it is chosen. Without an adapter:
        the engine's namespace. With one: also the adapter's content digest, since vLLM's block
        hashes name it by name and path only (an adapter retrained in place keeps both). None when
        the adapter cannot be read: its request is neither looked up nor stored."""
        if not lora_request:
            return self.view.space
        digest = self.adapters.digest(lora_request.lora_path)
        return None if digest is None else self.view.space.with_adapter(digest)

    def take_report(self, report: UCMWorkerReport) -> None:
        """The workers' answers after a step: confirmed and failed dumps, untrustworthy requests."""
        for req_id in report.load_failed:
            self._distrust(req_id, "load_failed")
        for req_id in report.not_blended:
            self._distrust(req_id, "forward_missing")
        for req_id in report.blend_error:
            self._distrust(req_id, "blend_error")
        self.view.confirm(report, report.load_failed | report.not_blended | report.blend_error)
        if report.load_failed or report.store_down_s:  # a block found stored may be gone: ask the store again
            self.view.forget_known()
        if report.store_down_s:  # a worker's load or dump timed out: the scheduler's lookups miss too
            self.view.store.hold_down(min(report.store_down_s, STORE_DOWN_HOLD_S))
        self.reads.take_report(report)

    def _distrust(self, req_id: str, reason: str) -> None:
        state = self._states.get(req_id)
        if state is None:
            return
        state.untrusted = True
        if reason in ("forward_missing", "blend_error"):
            state.blended = False
        if state.fallback != reason:
            state.fall_back(reason, self.stats)

    # ---- chunk layout -------------------------------------------------------------------

    def request_params(self, request: Request) -> tuple[dict, tuple[str, ...]]:
        """(the per-request parameters honoured, the names of those refused) of a request."""
        return self.params.honoured(request.kv_transfer_params)

    # ---- vLLM connector API (scheduler role) -------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.prompt_token_ids
        if not tokens:
            return 0, False
        state = self._states.get(request.request_id)
        if state is not None and state.allocated:
            # Preempted and back in the queue. A blend request is planned again from scratch: its
            # chunk KV is reloaded and blended as before (its blended blocks in vLLM's cache went
            # back to request-unique hashes that no lookup can match, see build_connector_meta).
            if not state.blending:
                return 0, False  # exact KV only: vLLM's own prefix cache serves what survived
            del self._states[request.request_id]
            self._resumed[request.request_id] = (state.preemptions + 1, state.num_dumped)
        resumed = self._resumed.get(request.request_id)
        if resumed is None and (request.num_computed_tokens > 0 or request.num_tokens > len(tokens)):
            return 0, False  # resumed without a plan of ours: vLLM's own cache handles it
        held = self._held_plan(request.request_id, num_computed_tokens)
        self._deferred.pop(request.request_id, None)
        if held is not None:
            state = held  # deferred at the step cap or planned ahead: no new lookups
        else:
            try:
                inject("lookup")
                state = self._plan(request, num_computed_tokens, resumed)
            except Exception as exc:  # a cache fault must not take the engine down: vLLM computes it
                state = self._failed_plan(request, num_computed_tokens, exc)
            if state is None:
                return None, False
        if (state.blending and resumed is None
                and self.reads.holds(request.request_id, lambda: chunk_prefetch(state, self.view))):
            self._deferred[request.request_id] = (num_computed_tokens, state)  # its plan is held meanwhile
            return None, False
        if state.blending:
            if self._waits_a_step(state):
                self.stats.add("blend_deferrals")
                self._deferred[request.request_id] = (num_computed_tokens, state)
                return None, False  # this step's Blend work is full: next step (vLLM keeps its place)
            first_approx = state.plan.first_approximate_token
            if first_approx is not None:
                state.exact_limit = first_approx
                self.hashes.salt(request, first_approx // self.block_size, state.preemptions)
        elif resumed is not None:
            state.fall_back("preempted", self.stats)  # its chunk KV is gone from the store: computed in full
        self._states[request.request_id] = state
        if state.blending:
            return state.blend_end - num_computed_tokens, False
        state.local_tokens = num_computed_tokens
        # An exact prefix alone may be read between steps while the others run (async_prefix_loads);
        # a Blend region's loads feed the step's forward.
        state.loads_between_steps = state.prefix_external > 0 and resumed is None and self.reads.prefix_between_steps()
        return state.prefix_external, state.loads_between_steps

    def planned_blend_work(self, request: Request) -> int:
        """Plans a waiting request before vLLM asks about it: the rows its Blend region would run
        (`region_work`), 0 when it would not blend. The plan is kept for vLLM's question (as a
        deferred request's is) when vLLM asks with no local prefix hit. For a scheduler that gives
        a blend request's step to it (BlendFirstScheduler)."""
        if (self.blend is None or not self.loads or request.request_id in self._states
                or request.request_id in self._resumed or request.num_computed_tokens > 0):
            return 0
        state = self._held_plan(request.request_id, 0)
        if state is None:
            state = self._plan(request, 0, None)
            if state is None:
                return 0  # waits for this engine's dumps
            self._deferred[request.request_id] = (0, state)
        return max(1, state.work) if state.blending else 0

    def _plan(self, request: Request, num_computed_tokens: int, resumed: tuple[int, int] | None) -> RequestState | None:
        return self.lookup.plan(request, self.keys_for(getattr(request, "lora_request", None)), num_computed_tokens,
                                resumed)

    def _waits_a_step(self, state: RequestState) -> bool:
        """Whether a blend request is deferred a step: held behind a shorter job (`hold_over`), or
        this step's Blend work is full (the first blend request of a step always fits)."""
        if self.hold_over is not None and state.work > self.hold_over:
            return True
        return bool(self._step_work) and (self._step_work + state.work > self.admit_cap
                                          or self._step_staged + state.staged > STAGED_PER_ROW * self.step_cap)

    def _held_plan(self, req_id: str, num_computed_tokens: int) -> RequestState | None:
        held = self._deferred.get(req_id)
        if held is None or held[0] != num_computed_tokens or time.monotonic() - held[1].planned_at > HELD_PLAN_SECONDS:
            return None
        return held[1]

    def _failed_plan(self, request: Request, num_computed_tokens: int, exc: BaseException) -> RequestState:
        """The plan of a request whose lookup raised: no external tokens, nothing stored."""
        self._errors.error("lookup", exc, "the request is computed by vLLM and nothing of it is stored")
        self.stats.add("lookup_errors")
        state = self.lookup.unplanned(request, num_computed_tokens)
        state.fall_back("blend_error", self.stats)
        return state

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._states.get(request.request_id)
        if state is None or state.allocated:
            return
        state.phase = Phase.ALLOCATED
        self._resumed.pop(request.request_id, None)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.num_external = num_external_tokens
        if state.loads_between_steps and num_external_tokens:  # vLLM parks it in WAITING_FOR_REMOTE_KVS
            state.phase = Phase.LOADING
            self._loads_to_start.append(state)
        if state.blending:
            self._step_work += state.work
            self._step_staged += state.staged
            count_only_reused_as_cached(request, state.work)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UCMConnectorMetadata:
        self.view.reap_record_writes()
        self.view.write_refs()  # those whose exact blocks were confirmed by the last steps' reports
        meta = UCMConnectorMetadata()
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._states.get(req_id)
            if state is not None and state.blending:
                # Its blocks were freed under their request-unique hashes and stay in vLLM's cache
                # until evicted; back to the exact hashes, so its next lookup cannot match them.
                self.hashes.restore(state.request)
        for state in self._loads_to_start:
            meta.requests.append(RequestStep(state.request.request_id, state.block_ids, state.local_tokens, 0,
                                             prefix_loads=self._prefix_loads(state, state.local_tokens),
                                             load_async=True))
        self._loads_to_start = []
        meta.prefetches = self.reads.take_prefetches()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            step = self._new_request_step(state, new.num_computed_tokens,
                                          scheduler_output.num_scheduled_tokens[new.req_id])
            if step is not None:
                meta.requests.append(step)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            if cached.new_block_ids[i] is not None:
                if req_id in cached.resumed_req_ids:  # a preempted request's blocks, anew
                    state.block_ids = list(cached.new_block_ids[i][0])
                else:
                    state.block_ids.extend(cached.new_block_ids[i][0])
            num_computed, num_scheduled = cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[req_id]
            if state.phase is Phase.STEPPED:
                step = self._dump_step(state, num_computed, num_scheduled)
            else:  # resumed after preemption and planned again (V1 runner: among the cached requests)
                step = self._new_request_step(state, num_computed, num_scheduled)
            if step is not None:
                meta.requests.append(step)
        if any((r.prefix_loads and not r.load_async) or r.chunk_loads or r.blend for r in meta.requests):
            # Loads must land before this step's forward (vLLM then calls start_load_kv first).
            scheduler_output.has_sync_kv_loads = True
        self._step_work = self._step_staged = 0
        return meta

    def request_finished(self, request: Request) -> dict | None:
        """Drop the request's state; return what the cache did for it (RequestOutput.kv_transfer_params)."""
        state = self._states.pop(request.request_id, None)
        self.hashes.forget(request.request_id)
        self._resumed.pop(request.request_id, None)
        self.lookup.forget(request.request_id, state)
        self._deferred.pop(request.request_id, None)
        self.reads.forget(request.request_id)
        if state is None:
            return None
        if self.background is not None and state.plan is not None:
            self._queue_missed_chunks(state)
        return state.report()

    # ---- internals ---------------------------------------------------------------------

    def _queue_missed_chunks(self, state: RequestState) -> None:
        """Queues the chunks the request missed, to be computed alone while the engine is idle."""
        params, _ = self.request_params(state.request)
        for chunk in missed_chunks(state, by_lengths=CHUNK_LENGTHS_PARAM in params):
            queued = self.background.offer(chunk)
            if queued is not None:
                self.stats.add("background_chunks_queued" if queued else "background_chunks_dropped")

    def stored(self, block_hash: bytes, lora_request: LoRARequest | None = None) -> bool:
        """Whether the store holds this block as exact KV, or this engine's dump of it is on its way;
        True too when the adapter cannot be read (its requests store nothing: none to compute)."""
        keys = self.keys_for(lora_request)
        return keys is None or self.view.stored(keys, block_hash)

    def _new_request_step(self, state: RequestState, num_computed: int, num_scheduled: int) -> RequestStep | None:
        step = RequestStep(state.request.request_id, state.block_ids, num_computed, num_scheduled)
        if state.phase is Phase.STEPPED:  # resumed without a new plan (V2 runner: among the new requests)
            step.dumps = self._dumps(state, num_computed + num_scheduled)
            return step if step.dumps else None
        loaded_between_steps = state.phase is Phase.LOADING
        state.phase = Phase.STEPPED
        if not state.preemptions:
            self.lookup.record_sightings(state)
        local = state.local_tokens if loaded_between_steps else num_computed - state.num_external
        if state.preemptions:
            self.stats.add("blend_preemptions")
        else:
            self.stats.add("requests")
            self.stats.add("prompt_tokens", state.prompt_len)
            if state.refused:
                self.stats.add("request_params_refused")
                logger.warning("request %s: ignoring %s (not allowed by ucm_sparse_config.Blend.request_params / "
                               "allow_oracle)", state.request.request_id, ", ".join(state.refused))
            if state.fallback in ("few_hits", "region_cut", "adapter_unreadable"):
                state.fall_back(state.fallback, self.stats)
            self.stats.add("local_prefix_tokens", local)
            self.stats.add("store_prefix_tokens", state.prefix_external)
        if not loaded_between_steps:
            step.prefix_loads = self._prefix_loads(state, local)
        if state.blending:
            step.blend, step.chunk_loads = first_blend_step(state, num_computed, local, self.view, self.stats)
        step.dumps = self._dumps(state, num_computed + num_scheduled)
        return step if (step.prefix_loads or step.blend or step.dumps) else None

    def _prefix_loads(self, state: RequestState, local: int) -> list[BlockLoad]:
        """The request's exact prefix blocks after vLLM's local hit of `local` tokens."""
        bs, hashes = self.block_size, self.hashes.original(state.request)
        return [BlockLoad(state.keys.key(KeyKind.EXACT, hashes[b]), b * bs, bs)
                for b in range(local // bs, (local + state.prefix_external) // bs)]

    def _dump_step(self, state: RequestState, num_computed: int, num_scheduled: int) -> RequestStep | None:
        dumps = self._dumps(state, num_computed + num_scheduled)
        if not dumps:
            return None
        return RequestStep(state.request.request_id, state.block_ids, num_computed, num_scheduled, dumps=dumps)

    def _dumps(self, state: RequestState, computed_end: int) -> list[BlockDump]:
        if state.untrusted or not self.stores:
            return []
        dumps = new_dumps(state, computed_end, self.hashes.original(state.request), self.view, self.blend)
        state.num_dumped += len(dumps)
        self.view.submitted(d.key for d in dumps)
        return dumps
