"""Scheduler half of the UCM connector: lookup, load plan, dump plan, prefix-cache hygiene.

One lookup serves both caches: vLLM's local prefix cache has already matched the leading blocks;
the store is asked for the next exact prefix blocks, then for every chunk block behind them.
Both are reported to vLLM as external tokens: the exact prefix, and the Blend region from there
to the prompt's last token. vLLM schedules and charges that one token, so a blend request fits
any step budget and chunked prefill and its question is never split off the blend; the Blend
forward runs the rows it needs from the region (misses, the question, the recomputed share)
beside the scheduled row, under a per-step cap of its own (docs/serving.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ucm.config import CHUNK_LENGTHS_PARAM, DISABLE_BLEND_PARAM, EXACT_PREFIX_PARAM, INDEX_PARAM
from ucm.integration.vllm.connector.background_chunks import BackgroundChunk, BackgroundChunks
from ucm.integration.vllm.connector.request_params import REPORT_KEY, RequestParamPolicy
from ucm.integration.vllm.connector.metadata import (BlendRegion, BlockDump, BlockLoad, RequestStep, UCMConnectorMetadata,
                                                    UCMWorkerReport)
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.faults import ErrorLog, inject
from ucm.sparse.blend.admission import (SIGHTING_RECORD, Admission, RecentHits, admits_first_sighting, asks_nothing,
                                        prompt_segments)
from ucm.sparse.blend.chunk_refs import REF_BYTES, ChunkRef, decode_ref, encode_ref, make_ref, ref_pieces
from ucm.sparse.blend.chunking import ChunkLayout, Span, split_by_lengths, split_by_marker
from ucm.sparse.blend.hashing import BlockHasher, IsolationKeys
from ucm.sparse.blend.plan import (BlendPlan, blend_region_end, bounded_region_end, build_plan, region_hit_share,
                                   region_work)
from ucm.store.keys import KeyKind, store_key

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ucm.config import UCMConfig
    from ucm.store.base import KVStoreBase, Task

logger = logging.getLogger(__name__)

# A request needing blocks whose dumps this engine submitted waits up to this long for the workers to
# confirm them (usually a step or two), then is planned with them as misses.
DUMP_WAIT_SECONDS = 2.0
# A plan held for a waiting request (deferred at the step cap, or planned ahead by
# BlendFirstScheduler) is used for this long; then it is made again: chunks stored since count.
HELD_PLAN_SECONDS = 2.0
# A step stages at most this many loaded tokens per row of its Blend cap (max_step_tokens): at ratio
# 0.15 a region of loaded chunks alone needs about 1 / 0.15 = 6.7.
STAGED_PER_ROW = 8
# A submitted dump no worker answered for this long is forgotten (the workers give up after dump_timeout_s).
PENDING_DUMP_SECONDS = 300.0
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass
class _RequestState:
    request: Request
    prompt_len: int
    plan: BlendPlan | None
    exact_stored: list[bool]  # per full prompt block: exact KV already in the store
    exact_limit: int  # prompt tokens before this have exact KV once computed
    prefix_external: int  # exact prefix tokens loaded from the store
    blend_end: int  # the Blend region is [plan.prefix_tokens, blend_end); empty: no blend
    ratio: float | None = None
    selection: str | None = None
    chunk_start_tokens: int = 0
    kv_shift: float = 0.0  # share of the chunk-mean error the reused KV is moved by
    work: int = 0  # rows the Blend forward runs beside the scheduled ones (region_work)
    staged: int = 0  # loaded tokens its region stages
    block_ids: list[int] = field(default_factory=list)
    num_external: int = 0
    admitted: bool = False  # blocks allocated: a later lookup means it was preempted
    stepped: bool = False  # its first step (loads, Blend region) was handed to the worker
    preemptions: int = 0  # times it was preempted and planned again
    blended: bool = False
    fallback: str | None = None  # why a request with loaded chunk KV was not (or not wholly) blended
    refused: tuple[str, ...] = ()  # per-request parameters it sent that the operator does not allow
    untrusted: bool = False  # a load failed or its region was not run: nothing more of it is dumped
    admission: Admission | None = None  # which segments it stores (admission.py); None: all
    indexing: bool = False  # it asks nothing (ends with a chunk) or sent ucm_index: stores on first sighting
    num_dumped: int = 0
    dumped_blocks: set[int] = field(default_factory=set)  # exact prefix blocks done
    dumped_chunk_blocks: set[int] = field(default_factory=set)  # indices into plan.blocks
    planned_at: float = field(default_factory=time.monotonic)

    @property
    def blending(self) -> bool:
        return self.blend_end > (self.plan.prefix_tokens if self.plan else self.prompt_len)


@dataclass(frozen=True)
class _WaitingRef:
    """A chunk reference written once every exact block it names is confirmed stored: a request
    whose dumps are refused or fail (an untrusted step) leaves no reference behind."""

    req_id: str
    key: bytes
    record: bytes
    sources: frozenset[bytes]  # store keys of the exact blocks
    since: float


def isolation_of(request: Request) -> IsolationKeys:
    """The request's tenant and adapter, as vLLM keys them in its block hashes."""
    lora = getattr(request, "lora_request", None)
    return IsolationKeys(("lora", lora.lora_name, lora.lora_path) if lora else None,
                         getattr(request, "cache_salt", None) or None)


def count_only_reused_as_cached(request: Request, computed_in_region: int) -> None:
    """vLLM counts every external token as cached in the request's prefill statistics (set just
    before update_state_after_alloc); a Blend region's misses, question and recomputed rows are
    computed. Moves them to computed, so `num_cached_tokens` (the API's usage.cached_tokens) and
    vLLM's prompt-token metrics count only KV served and kept. Preempted requests' statistics are
    not set again by vLLM, nor here."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None or request.num_preemptions > 0 or not computed_in_region:
        return
    external = max(0, stats.num_external_cached_tokens - computed_in_region)
    stats.set(stats.num_prompt_tokens, stats.num_local_cached_tokens, external)


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
        self._step_work = 0  # committed this step (admitted blend requests)
        self._step_staged = 0  # loaded tokens staged this step (admitted blend requests)
        self.store = store
        self.namespace = namespace
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._hasher: BlockHasher | None = None
        self._states: dict[str, _RequestState] = {}
        self._originals: dict[str, list[bytes]] = {}  # req_id -> block hashes before salting
        self._resumed: dict[str, tuple[int, int]] = {}  # preempted blend requests: (preemptions, dumped)
        self.num_shards = num_shards  # tensor-parallel ranks: a block is stored only when every rank's shard is
        self._pending: dict[bytes, float] = {}  # dumps submitted, not yet confirmed by every rank -> when
        self._confirmed: dict[bytes, int] = {}  # ranks that confirmed a pending dump so far
        self._awaited = False  # the current lookup missed a block whose dump is pending
        self._waiting: dict[str, float] = {}  # req_id -> when it started waiting for pending dumps
        self._deferred: dict[str, tuple[int, _RequestState]] = {}  # deferred at the cap: (computed, plan)
        self._refs_waiting: list[_WaitingRef] = []  # chunk references whose exact blocks are not yet confirmed
        # Records (chunk references, sightings) written by the store's threads, not yet reaped: (task,
        # records, counter prefix).
        self._record_writes: list[tuple[Task, list[bytes], str]] = []
        self.stats = UCMConnectorStats()  # this interval's counts, taken by vLLM after every step
        self._errors = ErrorLog(logger)
        self._lookup_timeouts = 0  # the store's count when last read
        self.params = RequestParamPolicy(self.blend)
        self._recent_hits = RecentHits()  # chunk lookups of the last requests (admission "adaptive")
        # Missed chunks to compute alone while idle (BlendFirstScheduler takes them); None: off.
        self.background = (BackgroundChunks() if self.blend and self.blend.computes_missed_chunks_alone
                           and self.stores else None)

    @property
    def hasher(self) -> BlockHasher:
        # vLLM initialises NONE_HASH when the engine core starts, after connectors may be built;
        # take it from vLLM itself so chunk hashes share the prefix cache's hash space exactly.
        if self._hasher is None:
            from vllm.v1.core import kv_cache_utils

            self._hasher = BlockHasher(self.hash_algo, self.block_size, kv_cache_utils.NONE_HASH)
        return self._hasher

    def key(self, kind: KeyKind, block_hash: bytes) -> bytes:
        return store_key(self.namespace, kind, block_hash)

    def lookup(self, kind: KeyKind, hashes) -> list[bool]:
        """Which blocks the store holds, every tensor-parallel rank's shard of them.

        Only dumps the store confirmed count: a block this engine submitted moments ago is a miss
        (and `_awaited` says so, so the request can wait for it) until every worker reported it stored.
        """
        if not hashes:
            return []
        keys = [self.key(kind, h) for h in hashes]
        start = time.perf_counter()
        found = self.store.lookup_shards(keys, self.num_shards)
        self.stats.add("lookup_seconds", time.perf_counter() - start)
        timeouts = self.store.stats().lookup_timeouts
        if timeouts != self._lookup_timeouts:  # the store did not answer in time: misses, computed
            self.stats.add("lookup_timeout_blocks", timeouts - self._lookup_timeouts)
            self._lookup_timeouts = timeouts
        if self._pending and any(not f and k in self._pending for f, k in zip(found, keys)):
            self._awaited = True
        return found

    def lookup_refs(self, blocks) -> list[ChunkRef | None]:
        """The references stored for these (chunk block hash, tokens), each only when every exact
        block it names is stored (every shard): a reference is only as good as its exact blocks."""
        keys = [self.key(KeyKind.CHUNK_REF, h) for h, _ in blocks]
        start = time.perf_counter()
        hits = self.store.lookup(keys)
        found = [i for i, hit in enumerate(hits) if hit]
        if self._refs_waiting or self._record_writes:  # this engine is about to write some: worth a short wait
            coming = {r.key for r in self._refs_waiting} | {k for task, _, _ in self._record_writes for k in task.keys}
            self._awaited |= any(not hit and k in coming for hit, k in zip(hits, keys))
        records = [bytearray(REF_BYTES) for _ in found]
        # Small reads on the scheduler's path: a lookup's deadline, not a KV load's (a mount that
        # answers stats but not reads must not hold every step for load_timeout_s).
        ok = (self.store.wait(self.store.load([keys[i] for i in found], records), self.store.metadata_timeout_s)
              if found else [])
        self.stats.add("lookup_seconds", time.perf_counter() - start)
        refs: dict[int, ChunkRef] = {}
        for i, record, good in zip(found, records, ok):
            ref = decode_ref(record, blocks[i][1], self.block_size) if good else None
            if ref is not None:
                refs[i] = ref
        sources = sorted({h for ref in refs.values() for h in ref.sources})
        stored = dict(zip(sources, self.lookup(KeyKind.EXACT, sources)))
        return [refs[i] if i in refs and all(stored[h] for h in refs[i].sources) else None
                for i in range(len(blocks))]

    def _write_refs(self) -> None:
        """Hand the chunk references whose exact blocks are all confirmed to the store (written by
        its IO threads); a reference waiting longer than a dump is waited for is dropped."""
        if not self._refs_waiting:
            return
        now = time.monotonic()
        ready, waiting = [], []
        for ref in self._refs_waiting:
            if not any(k in self._pending for k in ref.sources):
                ready.append(ref)
            elif now - ref.since < PENDING_DUMP_SECONDS:
                waiting.append(ref)
        self._refs_waiting = waiting
        if ready:
            self._write_records([r.key for r in ready], [r.record for r in ready], "chunk_refs")

    def _write_records(self, keys: list[bytes], records: list[bytes], counter: str) -> None:
        """Small records the scheduler writes (not KV): handed to the store's IO threads."""
        self._record_writes.append((self.store.dump(keys, records, [0] * len(keys)), records, counter))

    def _reap_record_writes(self) -> None:
        still = []
        for task, records, counter in self._record_writes:
            if self.store.check(task):
                ok = self.store.wait(task)
                self.stats.add(f"{counter}_stored", sum(ok))
                self.stats.add(f"{counter}_failed", len(ok) - sum(ok))
            else:
                still.append((task, records, counter))
        self._record_writes = still

    def take_report(self, report: UCMWorkerReport) -> None:
        """The workers' answers after a step: confirmed and failed dumps, untrustworthy requests."""
        for key, ranks in report.stored.items():
            confirmed = self._confirmed.pop(key, 0) + ranks
            if confirmed >= self.num_shards:
                self._pending.pop(key, None)
            elif key in self._pending:
                self._confirmed[key] = confirmed
        for key in report.not_stored:
            self._pending.pop(key, None)
            self._confirmed.pop(key, None)
        for req_id in report.load_failed:
            self._distrust(req_id, "load_failed")
        for req_id in report.not_blended:
            self._distrust(req_id, "forward_missing")
        for req_id in report.blend_error:
            self._distrust(req_id, "blend_error")
        if self._refs_waiting and (report.not_stored or report.load_failed or report.not_blended or report.blend_error):
            untrusted = report.load_failed | report.not_blended | report.blend_error
            self._refs_waiting = [r for r in self._refs_waiting
                                  if r.req_id not in untrusted and not r.sources & report.not_stored]
        if self._pending:
            now = time.monotonic()
            for key in [k for k, t in self._pending.items() if now - t > PENDING_DUMP_SECONDS]:
                del self._pending[key]
                self._confirmed.pop(key, None)

    def _distrust(self, req_id: str, reason: str) -> None:
        state = self._states.get(req_id)
        if state is None:
            return
        state.untrusted = True
        if reason in ("forward_missing", "blend_error"):
            state.blended = False
        if state.fallback != reason:
            self._fall_back(state, reason)

    # ---- chunk layout -------------------------------------------------------------------

    def request_params(self, request: Request) -> tuple[dict, tuple[str, ...]]:
        """(the per-request parameters honoured, the names of those refused) of a request."""
        return self.params.honoured(request.kv_transfer_params)

    def chunk_layout(self, request: Request, params: dict) -> ChunkLayout | None:
        if self.blend is None:
            return None
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            # Their KV depends on more than the token ids our chunk keys hash: never shared.
            self.stats.add("blend_skipped_multimodal")
            return None
        tokens = request.prompt_token_ids or []
        lengths = params.get(CHUNK_LENGTHS_PARAM)
        if lengths is not None:
            try:
                return split_by_lengths(len(tokens), lengths)
            except ValueError as exc:
                logger.warning("request %s: ignoring %s (%s); computing it normally",
                               request.request_id, CHUNK_LENGTHS_PARAM, exc)
                return None
        if self.blend.chunk_end_token_id is None:
            return None
        layout = split_by_marker(tokens, self.blend.chunk_end_token_id)
        return layout if layout.chunks else None

    # ---- vLLM connector API (scheduler role) -------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.prompt_token_ids
        if not tokens:
            return 0, False
        state = self._states.get(request.request_id)
        if state is not None and state.admitted:
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
        if state.blending:
            if self._step_work and (self._step_work + state.work > self.admit_cap
                                    or self._step_staged + state.staged > STAGED_PER_ROW * self.step_cap):
                self.stats.add("blend_deferrals")
                self._deferred[request.request_id] = (num_computed_tokens, state)
                return None, False  # this step's Blend work is full: next step (vLLM keeps its place)
            first_approx = state.plan.first_approximate_token
            if first_approx is not None:
                state.exact_limit = first_approx
                self._salt_hashes(request, first_approx // self.block_size, state.preemptions)
        elif resumed is not None:
            self._fall_back(state, "preempted")  # its chunk KV is gone from the store: computed in full
        self._states[request.request_id] = state
        return state.blend_end - num_computed_tokens if state.blending else state.prefix_external, False

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

    def _held_plan(self, req_id: str, num_computed_tokens: int) -> _RequestState | None:
        held = self._deferred.get(req_id)
        if held is None or held[0] != num_computed_tokens or time.monotonic() - held[1].planned_at > HELD_PLAN_SECONDS:
            return None
        return held[1]

    def _plan(self, request: Request, num_computed_tokens: int, resumed: tuple[int, int] | None) -> _RequestState | None:
        """Look the request up (exact prefix, then chunk blocks) and choose its Blend region; None
        when it should wait for dumps of blocks it needs that this engine is still writing."""
        self._restore_hashes(request)
        self._awaited = False
        tokens = request.prompt_token_ids
        bs = self.block_size
        prompt_len = len(tokens)
        num_full = prompt_len // bs
        hashes = self._original_hashes(request)[:num_full]
        exact_stored = self.lookup(KeyKind.EXACT, hashes)
        first = num_computed_tokens // bs
        hits = 0
        params, refused = self.request_params(request)
        use_prefix = self.loads and params.get(EXACT_PREFIX_PARAM, True) is not False
        # vLLM computes every prompt token of these (its own prefix cache skips them too).
        wants_prompt_logprobs = getattr(getattr(request, "sampling_params", None), "prompt_logprobs", None) is not None
        use_prefix &= not wants_prompt_logprobs
        while use_prefix and first + hits < num_full and exact_stored[first + hits]:
            hits += 1
        external = hits * bs
        if num_computed_tokens + external >= prompt_len:  # vLLM must compute at least one token
            external = max(0, prompt_len - 1 - num_computed_tokens) // bs * bs
        prefix_tokens = num_computed_tokens + external

        plan = None
        layout = None if wants_prompt_logprobs else self.chunk_layout(request, params)
        if layout is not None:
            plan = build_plan(layout, tokens, self.hasher, prefix_tokens, self.lookup, isolation_of(request),
                              self.lookup_refs if self.blend.chunk_refs else None)
        if self._awaited:  # blocks it needs are being written by this engine: wait for them a little
            since = self._waiting.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - since < DUMP_WAIT_SECONDS:
                self.stats.add("dump_waits")
                return None
        self._waiting.pop(request.request_id, None)
        state = _RequestState(request, prompt_len, plan, exact_stored, prompt_len, external, prefix_tokens)
        if resumed is not None:
            state.preemptions, state.num_dumped = resumed
        state.refused = refused
        state.indexing = asks_nothing(layout) or params.get(INDEX_PARAM) is True
        state.admission = self._admission(state.indexing, plan, hashes, exact_stored)
        if plan is not None and self.loads and not params.get(DISABLE_BLEND_PARAM):
            end = blend_region_end(plan, prompt_len)
            if end > plan.prefix_tokens and region_hit_share(plan, end) < self.blend.min_hit_share:
                state.fallback = "few_hits"  # vLLM computes it; counted at its first step
            else:
                ratio = self.params.ratio(request.request_id, params)
                # A region with more work than one step's cap is cut; vLLM's chunked prefill does the rest.
                state.blend_end = bounded_region_end(plan, end, ratio, self.step_cap, STAGED_PER_ROW * self.step_cap)
                if state.blend_end < end:
                    state.fallback = "region_cut"  # counted at its first step
                if not any(b.placed.start < state.blend_end for b in plan.loaded):
                    state.blend_end = plan.prefix_tokens  # nothing loaded left in it: vLLM computes it all
        if state.blending:
            chosen = self.params.blend_params(request.request_id, params, ratio)
            state.ratio, state.selection = chosen.ratio, chosen.selection
            state.chunk_start_tokens, state.kv_shift = chosen.chunk_start_tokens, chosen.kv_shift
            state.work = region_work(plan, state.blend_end, state.ratio)
            state.staged = sum(len(b.placed) for b in plan.loaded if b.placed.start < state.blend_end)
        return state

    def _admission(self, indexing: bool, plan: BlendPlan | None, hashes: list[bytes],
                   exact_stored: list[bool]) -> Admission | None:
        """Which of the request's segments were computed before (their KV is stored when computed
        now); None: everything is (first-sighting policy, an indexing request, nothing to store)."""
        if (not self.stores or self.blend is None or indexing
                or admits_first_sighting(self.blend.admission, self._recent_hits)):
            return None
        if all(exact_stored) and (plan is None or not plan.missed):
            return None
        segments = prompt_segments(plan.layout if plan else None, plan.chunk_last_hashes if plan else (), hashes,
                                   self.block_size)
        start = time.perf_counter()
        # A sighting the store does not answer for in time counts as none: the KV is not stored.
        keys = [self.key(KeyKind.SIGHTING, s.fingerprint) for s in segments]
        seen = self.store.lookup(keys)
        self.stats.add("lookup_seconds", time.perf_counter() - start)
        writing = {k for task, _, counter in self._record_writes if counter == "sightings" for k in task.keys}
        return Admission(tuple(segments), tuple(hit or k in writing for hit, k in zip(seen, keys)))

    def _record_sightings(self, state: _RequestState) -> None:
        """Records the segments the request computes for the first time (admission.py), and how
        much of what it looked up it found (an indexing request looks up what it is about to store)."""
        if state.plan is not None and not state.indexing:
            self._recent_hits.add(len(state.plan.loaded), len(state.plan.blocks))
        fingerprints = state.admission.first_sightings() if state.admission else []
        if fingerprints:
            self._write_records([self.key(KeyKind.SIGHTING, h) for h in fingerprints],
                                [SIGHTING_RECORD] * len(fingerprints), "sightings")

    def _failed_plan(self, request: Request, num_computed_tokens: int, exc: BaseException) -> _RequestState:
        """The plan of a request whose lookup raised: no external tokens, nothing stored."""
        self._errors.error("lookup", exc, "the request is computed by vLLM and nothing of it is stored")
        self.stats.add("lookup_errors")
        self._restore_hashes(request)
        self._waiting.pop(request.request_id, None)
        tokens = request.prompt_token_ids
        state = _RequestState(request, len(tokens), None, [False] * (len(tokens) // self.block_size), len(tokens),
                              0, num_computed_tokens)
        state.untrusted = True
        self._fall_back(state, "blend_error")
        return state

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._states.get(request.request_id)
        if state is None or state.admitted:
            return
        state.admitted = True
        self._resumed.pop(request.request_id, None)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.num_external = num_external_tokens
        if state.blending:
            self._step_work += state.work
            self._step_staged += state.staged
            count_only_reused_as_cached(request, state.work)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UCMConnectorMetadata:
        self._reap_record_writes()
        self._write_refs()  # those whose exact blocks were confirmed by the last steps' reports
        meta = UCMConnectorMetadata()
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._states.get(req_id)
            if state is not None and state.blending:
                # Its blocks were freed under their request-unique hashes and stay in vLLM's cache
                # until evicted; back to the exact hashes, so its next lookup cannot match them.
                self._restore_hashes(state.request)
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
            if state.stepped:
                step = self._dump_step(state, num_computed, num_scheduled)
            else:  # resumed after preemption and planned again (V1 runner: among the cached requests)
                step = self._new_request_step(state, num_computed, num_scheduled)
            if step is not None:
                meta.requests.append(step)
        if any(r.prefix_loads or r.chunk_loads or r.blend for r in meta.requests):
            # Loads must land before this step's forward (vLLM then calls start_load_kv first).
            scheduler_output.has_sync_kv_loads = True
        self._step_work = self._step_staged = 0
        return meta

    def request_finished(self, request: Request) -> dict | None:
        """Drop the request's state; return what the cache did for it (RequestOutput.kv_transfer_params)."""
        state = self._states.pop(request.request_id, None)
        self._originals.pop(request.request_id, None)
        self._resumed.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._deferred.pop(request.request_id, None)
        if state is None:
            return None
        plan = state.plan
        if self.background is not None and plan is not None:
            self._queue_missed_chunks(state)
        return {REPORT_KEY: {
            "prompt_tokens": state.prompt_len,
            "external_prefix_tokens": state.prefix_external,
            "blend_region_tokens": state.num_external - state.prefix_external,
            "chunk_blocks": len(plan.blocks) if plan else 0,
            "chunk_hit_blocks": len(plan.loaded) if plan else 0,
            "chunk_hit_tokens": plan.num_loaded_tokens if plan else 0,
            "chunk_hits": [list(c) for c in plan.chunk_hits()] if plan else [],
            "blended": state.blended,
            "ratio": state.ratio,
            "selection": state.selection,
            "chunk_start_tokens": state.chunk_start_tokens,
            "kv_shift": state.kv_shift,
            "fallback": state.fallback,
            "preemptions": state.preemptions,
            "refused_params": list(state.refused),
            "dumped_blocks": state.num_dumped,
            # segments (chunks, the suffix) computed for the first time: a sighting stored, not their KV
            "first_sightings": len(state.admission.first_sightings()) if state.admission else 0,
        }}

    # ---- internals ---------------------------------------------------------------------

    def _queue_missed_chunks(self, state: _RequestState) -> None:
        """Queues every chunk after the prompt's first with a block the store did not have, to be
        computed alone while the engine is idle (background_chunks.py)."""
        request = state.request
        params, _ = self.request_params(request)
        by_lengths = CHUNK_LENGTHS_PARAM in params  # alone, the chunk is given its length the same way
        blocks: dict[int, list] = {}
        for blk in state.plan.blocks:
            blocks.setdefault(blk.chunk_start, []).append(blk)
        tokens = request.prompt_token_ids
        for span in state.plan.layout.chunks[1:]:
            chunk_blocks = blocks.get(span.start)
            if not chunk_blocks or all(b.hit for b in chunk_blocks):
                continue
            if state.admission and not state.admission.admits(span):
                continue  # first sighting: computed alone only when it comes again
            last = max(chunk_blocks, key=lambda b: b.tokens.end)
            queued = self.background.offer(BackgroundChunk(
                tuple(tokens[span.start:span.end]), last.block_hash,
                getattr(request, "lora_request", None), getattr(request, "cache_salt", None),
                getattr(request, "_block_hasher", None),
                {CHUNK_LENGTHS_PARAM: [len(span)]} if by_lengths else None))
            if queued is not None:
                self.stats.add("background_chunks_queued" if queued else "background_chunks_dropped")

    def stored(self, block_hash: bytes) -> bool:
        """Whether the store holds this block as exact KV (every tensor-parallel rank's shard of
        it), or this engine's dump of it is on its way."""
        return self.key(KeyKind.EXACT, block_hash) in self._pending or self.lookup(KeyKind.EXACT, [block_hash])[0]

    def _new_request_step(self, state: _RequestState, num_computed: int, num_scheduled: int) -> RequestStep | None:
        bs = self.block_size
        step = RequestStep(state.request.request_id, state.block_ids, num_computed, num_scheduled)
        if state.stepped:  # resumed without a new plan (V2 runner: among the new requests)
            step.dumps = self._dumps(state, num_computed + num_scheduled)
            return step if step.dumps else None
        state.stepped = True
        if not state.preemptions:
            self._record_sightings(state)
        local = num_computed - state.num_external
        if state.preemptions:
            self.stats.add("blend_preemptions")
        else:
            self.stats.add("requests")
            self.stats.add("prompt_tokens", state.prompt_len)
            if state.refused:
                self.stats.add("request_params_refused")
                logger.warning("request %s: ignoring %s (not allowed by ucm_sparse_config.Blend.request_params / "
                               "allow_oracle)", state.request.request_id, ", ".join(state.refused))
            if state.fallback in ("few_hits", "region_cut"):
                self._fall_back(state, state.fallback)
            self.stats.add("local_prefix_tokens", local)
            self.stats.add("store_prefix_tokens", state.prefix_external)
        hashes = self._original_hashes(state.request)
        for b in range(local // bs, (local + state.prefix_external) // bs):
            step.prefix_loads.append(BlockLoad(self.key(KeyKind.EXACT, hashes[b]), b * bs, bs))
        plan = state.plan
        if state.blending:
            start = local + state.prefix_external
            if num_computed != state.blend_end or start != plan.prefix_tokens:
                # vLLM took fewer external tokens than offered: blend what it counts as computed.
                logger.warning("request %s: vLLM counts %d tokens computed, the Blend region ends at %d",
                               state.request.request_id, num_computed, state.blend_end)
                self._fall_back(state, "external_trimmed")
            end = min(num_computed, state.blend_end)
            if plan.prefix_tokens < end:
                state.blended = True
                tokens = state.request.prompt_token_ids
                step.blend = BlendRegion(plan.prefix_tokens, list(tokens[plan.prefix_tokens:end]), state.ratio,
                                         state.selection, state.prompt_len,
                                         sorted({b.chunk_start for b in plan.loaded}), state.chunk_start_tokens,
                                         state.kv_shift)
                loaded = [b for b in plan.loaded if b.placed.start < end]
                if not state.preemptions:
                    self.stats.add("blended_requests")
                    self.stats.add("chunk_hit_tokens", sum(len(b.placed) for b in loaded))
                for blk in loaded:
                    if blk.ref is None:
                        step.chunk_loads.append(BlockLoad(self.key(blk.kind, blk.block_hash), blk.tokens.start,
                                                          len(blk.tokens), blk.chunk_start, blk.skip))
                        continue
                    self.stats.add("chunk_ref_hit_blocks")
                    for piece in ref_pieces(blk.ref, blk.placed, blk.tokens.start):
                        step.chunk_loads.append(BlockLoad(self.key(KeyKind.EXACT, piece.source), piece.start,
                                                          len(piece.rows), piece.rope_delta,
                                                          rows_from=piece.rows.start, stored_tokens=bs))
        step.dumps = self._dumps(state, num_computed + num_scheduled)
        return step if (step.prefix_loads or step.blend or step.dumps) else None

    def _fall_back(self, state: _RequestState, reason: str) -> None:
        """Says why a request with loaded chunk KV is not (wholly) blended: counter, report and log."""
        state.fallback = reason
        self.stats.add(f"blend_fallbacks_{reason}")
        logger.info("request %s: Blend falls back (%s)", state.request.request_id, reason)

    def _dump_step(self, state: _RequestState, num_computed: int, num_scheduled: int) -> RequestStep | None:
        dumps = self._dumps(state, num_computed + num_scheduled)
        if not dumps:
            return None
        return RequestStep(state.request.request_id, state.block_ids, num_computed, num_scheduled, dumps=dumps)

    def _dumps(self, state: _RequestState, computed_end: int) -> list[BlockDump]:
        if state.untrusted or not self.stores:
            return []
        dumps = self._new_dumps(state, computed_end)
        state.num_dumped += len(dumps)
        now = time.monotonic()
        for d in dumps:
            self._pending[d.key] = now
        return dumps

    def _new_dumps(self, state: _RequestState, computed_end: int) -> list[BlockDump]:
        """Blocks whose KV is complete after this step and not yet stored."""
        bs = self.block_size
        dumps: list[BlockDump] = []
        end = min(computed_end, state.exact_limit, state.prompt_len)
        hashes = self._original_hashes(state.request)
        for b in range(end // bs):
            if b in state.dumped_blocks or b >= len(state.exact_stored):
                continue
            state.dumped_blocks.add(b)
            if state.exact_stored[b]:
                continue
            if state.admission and not state.admission.admits(Span(b * bs, (b + 1) * bs)):
                self.stats.add("blocks_not_admitted")
                continue
            dumps.append(BlockDump(self.key(KeyKind.EXACT, hashes[b]), b * bs, bs))
        plan = state.plan
        if plan is None:
            return dumps
        # Exact blocks hold the prompt's KV up to `covered` now and up to `coverable` once computed.
        coverable = min(state.exact_limit, state.prompt_len) // bs * bs
        covered = end // bs * bs
        for i, blk in enumerate(plan.blocks):
            if blk.hit or i in state.dumped_chunk_blocks or blk.tokens.end > min(computed_end, state.prompt_len):
                continue
            exact = blk.chunk_start == 0 and blk.tokens.end <= state.exact_limit
            as_ref = not exact and self.blend.chunk_refs and blk.tokens.end <= coverable
            if as_ref and blk.tokens.end > covered:
                continue  # its exact blocks are complete after a later step
            state.dumped_chunk_blocks.add(i)
            if exact and len(blk.tokens) == bs:
                continue  # a full exact block at the prompt start is the prefix dump above
            if not exact and self.blend.chunk_store == "alone":
                continue  # computed after other text: that text must not shape what others reuse
            if state.admission and not state.admission.admits(blk.tokens):
                continue  # first sighting of its chunk (its exact blocks are counted above)
            ref = make_ref(blk.tokens, hashes[:state.prompt_len // bs], bs) if as_ref else None
            if ref is not None:  # its KV is in the exact blocks dumped above: stored once, found through a reference
                self._refs_waiting.append(_WaitingRef(
                    state.request.request_id, self.key(KeyKind.CHUNK_REF, blk.block_hash), encode_ref(ref),
                    frozenset(self.key(KeyKind.EXACT, h) for h in ref.sources), time.monotonic()))
                continue
            kind = KeyKind.EXACT if exact else KeyKind.CHUNK
            dumps.append(BlockDump(self.key(kind, blk.block_hash), blk.tokens.start, len(blk.tokens), blk.chunk_start))
        return dumps

    def _restore_hashes(self, request: Request) -> None:
        original = self._originals.pop(request.request_id, None)
        if original is not None:
            request.block_hashes[:len(original)] = original

    def _original_hashes(self, request: Request) -> list[bytes]:
        """The request's exact-prefix hashes, also after its tail was salted."""
        original = self._originals.get(request.request_id)
        return original if original is not None else list(request.block_hashes)

    def _salt_hashes(self, request: Request, from_block: int, generation: int = 0) -> None:
        """Give blocks holding blended (approximate) KV hashes no other request can match.

        vLLM registers a request's full blocks in its prefix cache under `request.block_hashes`
        when it allocates them; approximate KV must never be served as an exact prefix, so the
        hashes from the first approximate block on are replaced by request-unique ones (blocks
        appended later chain from them and are unique too). A preempted request blends anew under
        a new generation: its old blended blocks may still sit in vLLM's cache.
        """
        if request.request_id in self._originals:
            return
        original = list(request.block_hashes)
        self._originals[request.request_id] = original
        salt = b"ucm-blend-approx" + request.request_id.encode() + generation.to_bytes(4, "little")
        for i in range(from_block, len(original)):
            request.block_hashes[i] = hashlib.sha256(salt + original[i]).digest()[: len(original[i])]
