"""A request looked up and planned: exact prefix blocks, then chunk blocks, which of its segments
were seen before (admission), and its Blend region. The scheduler half asks for a plan when vLLM
asks about a waiting request, or ahead of that (BlendFirstScheduler); what it does with the plan
(admission under the step cap, steps, dumps) stays in scheduler_side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from ucm.config import DISABLE_BLEND_PARAM, EXACT_PREFIX_PARAM, INDEX_PARAM
from ucm.integration.vllm.connector.approximate_hashes import ApproximateHashes
from ucm.integration.vllm.connector.request_params import RequestParamPolicy
from ucm.integration.vllm.connector.request_plan import choose_region, chunk_layout
from ucm.integration.vllm.connector.request_state import RequestState, isolation_of
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.connector.store_view import SIGHTINGS, KeySpace, StoreView
from ucm.sparse.blend.admission import (SIGHTING_RECORD, Admission, RecentHits, admits_first_sighting, asks_nothing,
                                        prompt_segments, reused_unstored)
from ucm.sparse.blend.hashing import BlockHasher
from ucm.sparse.blend.plan import BlendPlan, build_plan
from ucm.store.keys import KeyKind

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm.config.blend import BlendConfig

logger = logging.getLogger(__name__)

# A request needing blocks whose dumps this engine submitted waits up to this long for the workers to
# confirm them (usually a step or two), then is planned with them as misses.
DUMP_WAIT_SECONDS = 2.0
# Exact prompt blocks looked up past vLLM's own prefix hits before the rest are.
EXACT_PROBE_BLOCKS = 8


class RequestLookup:
    def __init__(self, blend: BlendConfig | None, view: StoreView, hashes: ApproximateHashes,
                 hasher: Callable[[], BlockHasher], params: RequestParamPolicy, stats: UCMConnectorStats,
                 block_size: int, step_cap: int, loads: bool, stores: bool):
        self.blend = blend
        self.view = view
        self.hashes = hashes
        self.hasher = hasher  # vLLM's block hasher, known once the engine core has started
        self.params = params
        self.stats = stats
        self.block_size = block_size
        self.step_cap = step_cap
        self.loads = loads
        self.stores = stores
        self.recent_hits = RecentHits()  # chunk lookups of the last requests (admission "adaptive")
        self._waiting: dict[str, float] = {}  # req_id -> when it started waiting for pending dumps

    def plan(self, request: Request, keys: KeySpace | None, num_computed_tokens: int,
             resumed: tuple[int, int] | None) -> RequestState | None:
        """Look the request up (exact prefix, then chunk blocks) and choose its Blend region; None
        when it should wait for dumps of blocks it needs that this engine is still writing. `keys`
        None: its adapter cannot be read, so it is neither looked up nor stored."""
        if keys is None:
            state = self.unplanned(request, num_computed_tokens)
            state.fallback = "adapter_unreadable"  # counted at its first step
            return state
        self.hashes.restore(request)
        self.view.begin()
        tokens = request.prompt_token_ids
        bs = self.block_size
        prompt_len = len(tokens)
        num_full = prompt_len // bs
        hashes = self.hashes.original(request)[:num_full]
        lookup = partial(self.view.lookup, keys)
        first = num_computed_tokens // bs
        exact_stored = leading_hits(partial(self.view.lookup, keys, known=False), hashes, first)
        hits = 0
        params, refused = self.params.honoured(request.kv_transfer_params)
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
        layout = None if wants_prompt_logprobs or self.blend is None else chunk_layout(request, params, self.blend,
                                                                                      self.stats)
        if layout is not None:
            plan = build_plan(layout, tokens, self.hasher(), prefix_tokens, lookup, isolation_of(request),
                              partial(self.view.lookup_refs, keys) if self.blend.chunk_refs else None,
                              lookup_many=partial(self.view.lookup_many, keys))
        if self.view.awaited:  # blocks it needs are being written by this engine: wait for them a little
            since = self._waiting.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - since < DUMP_WAIT_SECONDS:
                self.stats.add("dump_waits")
                return None
        self._waiting.pop(request.request_id, None)
        state = RequestState(request, keys, prompt_len, plan, exact_stored, prompt_len, external, prefix_tokens)
        if resumed is not None:
            state.preemptions, state.num_dumped = resumed
        state.refused = refused
        state.indexing = asks_nothing(layout) or params.get(INDEX_PARAM) is True
        state.admission = self._admission(keys, state.indexing, plan, hashes, exact_stored)
        state.warm_lookup = self.recent_hits.warm
        if plan is not None and self.loads and not params.get(DISABLE_BLEND_PARAM):
            choose_region(state, params, self.params, self.blend.min_hit_share, self.step_cap)
        return state

    def _admission(self, keys: KeySpace, indexing: bool, plan: BlendPlan | None, hashes: list[bytes],
                   exact_stored: list[bool]) -> Admission | None:
        """Which of the request's segments were computed before (their KV is stored when computed
        now); None: everything is (first-sighting policy, an indexing request, nothing to store)."""
        if (not self.stores or self.blend is None or indexing
                or admits_first_sighting(self.blend.admission, self.recent_hits)):
            return None
        if all(exact_stored) and (plan is None or not plan.missed):
            return None
        segments = prompt_segments(plan.layout if plan else None, plan.chunk_last_hashes if plan else (), hashes,
                                   self.block_size)
        return Admission(tuple(segments), tuple(self.view.seen(keys, [s.fingerprint for s in segments])))

    def record_sightings(self, state: RequestState) -> None:
        """Records the segments the request computes for the first time (admission.py), and how
        much of what it looked up it found (an indexing request looks up what it is about to store)."""
        if state.plan is not None and not state.indexing:
            self.recent_hits.add(len(state.plan.loaded) + reused_unstored(state.plan.missed, state.admission),
                                 len(state.plan.blocks), state.warm_lookup)
        fingerprints = state.admission.first_sightings() if state.admission else []
        if fingerprints:
            self.view.write_records([state.keys.key(KeyKind.SIGHTING, h) for h in fingerprints],
                                    [SIGHTING_RECORD] * len(fingerprints), SIGHTINGS)

    def unplanned(self, request: Request, num_computed_tokens: int) -> RequestState:
        """A request left to vLLM alone: no external tokens, nothing of it stored."""
        self.hashes.restore(request)
        self._waiting.pop(request.request_id, None)
        tokens = request.prompt_token_ids
        state = RequestState(request, None, len(tokens), None, [False] * (len(tokens) // self.block_size),
                             len(tokens), 0, num_computed_tokens)
        state.untrusted = True
        return state

    def forget(self, req_id: str, state: RequestState | None = None) -> None:
        """Drops what the lookup kept of a request; `state`: it finished (its KV and sightings are
        in the store, so later lookups could find them)."""
        self._waiting.pop(req_id, None)
        if state is not None and state.plan is not None:
            self.recent_hits.warm = True


def leading_hits(lookup: Callable[[KeyKind, list[bytes]], list[bool]], hashes: list[bytes], first: int) -> list[bool]:
    """Which exact prompt blocks are stored, asking for those past the first EXACT_PROBE_BLOCKS
    after vLLM's own hits (``first``) only when all of those are: an exact block's hash names
    its whole prefix, so one stored after a missing one is rare, and only its dump would use it
    (which checks again). A prompt of new text costs one short lookup, not one per block."""
    head = first + EXACT_PROBE_BLOCKS
    found = lookup(KeyKind.EXACT, hashes[:head])
    if len(hashes) <= head:
        return found
    if all(found[first:]):
        return found + lookup(KeyKind.EXACT, hashes[head:])
    return found + [False] * (len(hashes) - head)
