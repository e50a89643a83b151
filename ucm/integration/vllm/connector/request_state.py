"""What the scheduler half keeps per request: its plan, where it is in its lifecycle, what it
stored, and the report it ends with."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ucm.integration.vllm.connector.request_params import REPORT_KEY
from ucm.integration.vllm.connector.store_view import KeySpace
from ucm.sparse.blend.admission import Admission
from ucm.sparse.blend.hashing import IsolationKeys
from ucm.sparse.blend.plan import BlendPlan

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm.integration.vllm.connector.stats import UCMConnectorStats

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """A request's lifecycle in the scheduler half. A preempted blend request is planned anew
    (a new state in PLANNED); one with exact KV only stays where it was."""

    PLANNED = "planned"  # looked up and planned; vLLM has not allocated its blocks
    ALLOCATED = "allocated"  # blocks allocated; its first step (loads, Blend region) not yet handed over
    LOADING = "loading"  # blocks allocated, its exact prefix read between steps; nothing scheduled yet
    STEPPED = "stepped"  # its first step was handed to the workers; later steps only dump


@dataclass
class RequestState:
    request: Request
    keys: KeySpace | None  # its store keys' namespace (SchedulerSide.keys_for); None: nothing looked up or stored
    prompt_len: int
    plan: BlendPlan | None
    exact_stored: list[bool]  # per full prompt block: exact KV already in the store
    exact_limit: int  # prompt tokens before this have exact KV once computed
    prefix_external: int  # exact prefix tokens loaded from the store
    blend_end: int  # the Blend region is [plan.prefix_tokens, blend_end); empty: no blend
    phase: Phase = Phase.PLANNED
    local_tokens: int = 0  # prompt tokens vLLM's own prefix cache held when it asked (before prefix_external)
    loads_between_steps: bool = False  # its exact prefix is read between steps (vLLM's async load path)
    ratio: float | None = None
    selection: str | None = None
    chunk_start_tokens: int = 0
    kv_shift: float = 0.0  # share of the chunk-mean error the reused KV is moved by
    kv_shift_sample: float = 0.0  # share of each loaded chunk's tokens, evenly spaced, that estimate the shift
    work: int = 0  # rows the Blend forward runs beside the scheduled ones (region_work)
    staged: int = 0  # loaded tokens its region stages
    block_ids: list[int] = field(default_factory=list)
    num_external: int = 0
    preemptions: int = 0  # times it was preempted and planned again
    blended: bool = False
    fallback: str | None = None  # why a request with loaded chunk KV was not (or not wholly) blended
    refused: tuple[str, ...] = ()  # per-request parameters it sent that the operator does not allow
    untrusted: bool = False  # a load failed or its region was not run: nothing more of it is dumped
    admission: Admission | None = None  # which segments it stores (admission.py); None: all
    warm_lookup: bool = True  # planned after a request of this engine finished (its lookup is evidence)
    indexing: bool = False  # it asks nothing (ends with a chunk) or sent ucm_index: stores on first sighting
    num_dumped: int = 0
    dumped_blocks: set[int] = field(default_factory=set)  # exact prefix blocks done
    dumped_chunk_blocks: set[int] = field(default_factory=set)  # indices into plan.blocks
    planned_at: float = field(default_factory=time.monotonic)

    @property
    def blending(self) -> bool:
        return self.blend_end > (self.plan.prefix_tokens if self.plan else self.prompt_len)

    @property
    def allocated(self) -> bool:
        return self.phase is not Phase.PLANNED

    def fall_back(self, reason: str, stats: UCMConnectorStats) -> None:
        """Says why a request with loaded chunk KV is not (wholly) blended: counter, report and log."""
        self.fallback = reason
        stats.add(f"blend_fallbacks_{reason}")
        logger.info("request %s: Blend falls back (%s)", self.request.request_id, reason)

    def report(self) -> dict:
        """What the cache did for the request (RequestOutput.kv_transfer_params)."""
        plan = self.plan
        return {REPORT_KEY: {
            "prompt_tokens": self.prompt_len,
            "external_prefix_tokens": self.prefix_external,
            "blend_region_tokens": self.num_external - self.prefix_external,
            "chunk_blocks": len(plan.blocks) if plan else 0,
            "chunk_hit_blocks": len(plan.loaded) if plan else 0,
            "chunk_hit_tokens": plan.num_loaded_tokens if plan else 0,
            "chunk_hits": [list(c) for c in plan.chunk_hits()] if plan else [],
            "blended": self.blended,
            "ratio": self.ratio,
            "selection": self.selection,
            "chunk_start_tokens": self.chunk_start_tokens,
            "kv_shift": self.kv_shift,
            "kv_shift_sample": self.kv_shift_sample,
            "fallback": self.fallback,
            "preemptions": self.preemptions,
            "refused_params": list(self.refused),
            "dumped_blocks": self.num_dumped,
            # segments (chunks, the suffix) computed for the first time: a sighting stored, not their KV
            "first_sightings": len(self.admission.first_sightings()) if self.admission else 0,
        }}


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
