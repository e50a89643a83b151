"""The connector's counters, reported through vLLM's connector statistics API.

The scheduler and every worker count what they did in a step and hand the counts to vLLM from
`get_kv_connector_stats()`; vLLM sums them across workers and with the scheduler's, logs them
with its periodic stats ("KV Transfer metrics: ...") and exports each one as a Prometheus
counter `vllm:ucm_<name>_total`, which `LLM.get_metrics()` and the server's /metrics show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# name -> meaning (the Prometheus help text). Counters only: every value is a sum over steps.
COUNTERS: dict[str, str] = {
    # scheduler
    "requests": "Requests the UCM connector planned when they were first scheduled",
    "prompt_tokens": "Prompt tokens of those requests",
    "local_prefix_tokens": "Prompt tokens served by vLLM's local prefix cache (exact)",
    "store_prefix_tokens": "Prompt tokens served as an exact prefix from the UCM store",
    "chunk_hit_tokens": "Prompt tokens whose chunk KV was found in the store and loaded for Blend",
    "blended_requests": "Requests computed with the Blend sparse forward",
    "blend_skipped_multimodal": "Requests with multimodal inputs or prompt embeddings: chunk KV neither looked up nor stored",
    "request_params_refused": "Requests that sent per-request parameters the operator does not allow (ignored)",
    "blend_deferrals": "Times a blend request waited a step because the step's Blend work was at its cap",
    "blend_first_steps": "Steps BlendFirstScheduler kept short (other prefills held to one token) to admit a blend request",
    "blend_first_reorders": "Blend requests BlendFirstScheduler moved to the head of vLLM's waiting queue",
    "blend_first_yields": "Steps BlendFirstScheduler admitted no blend request: a running prefill had been passed "
                          "MAX_PASSES_PER_PREFILL times",
    "blend_holds": "Steps BlendFirstScheduler admitted no request so that a running prefill ended before a long "
                   "Blend region at the head of the queue",
    "background_chunks_queued": "Missed chunks queued to be computed alone while no request is waiting or running (background_chunks)",
    "background_chunks_dropped": "Missed chunks not queued: the queue of chunks to compute alone was full",
    "background_chunks_started": "Chunks BlendFirstScheduler sent alone to the model while no user request was waiting or running",
    "background_chunks_computed": "Chunks computed alone in the background (their KV stored like an indexing request's)",
    "background_chunks_stopped": "Chunks computed alone that a user request's arrival stopped (queued again)",
    "background_chunks_skipped": "Queued chunks already stored when their turn came (not computed)",
    "blend_preemptions": "Blended requests preempted and blended again on readmission (chunk KV reloaded)",
    "blend_fallbacks_preempted": "Preempted blended requests whose chunk KV was gone on readmission (computed in full)",
    "blend_fallbacks_external_trimmed": "Blend requests whose region vLLM cut short (the rest computed in full)",
    "blend_fallbacks_few_hits": "Requests with chunk hits below min_hit_share of their tokens, left to vLLM's own prefill",
    "blend_fallbacks_region_cut": "Blend requests whose region had more work than max_step_tokens: cut to fit, the rest computed by vLLM's chunked prefill",
    "blend_fallbacks_load_failed": "Requests with a failed or timed-out load (failed chunk blocks computed in full, a failed prefix recomputed; nothing of theirs stored)",
    "blend_fallbacks_forward_missing": "Blend requests whose region the model forward did not run (not the Blend model class; nothing of the step stored)",
    "blend_fallbacks_blend_error": "Requests handed back to vLLM's own computation after an error in the cache path (lookup, load, rotation, selection or Blend forward; nothing of theirs stored)",
    "blend_fallbacks_adapter_unreadable": "Requests whose LoRA adapter could not be read to identify it by content (its directory, adapter_config.json or weight files): computed by vLLM, nothing of theirs looked up or stored",
    "lookup_errors": "Requests whose store lookup or plan raised (computed by vLLM, nothing of theirs stored)",
    "dump_waits": "Times a request waited a step for dumps of its blocks to be confirmed by the store",
    "chunk_prefetches": "Blend requests held in the queue while the workers read their chunk blocks (prefetch_chunks)",
    "lookup_seconds": "Seconds the scheduler spent in store lookups",
    "lookup_rounds": "Calls the scheduler's store lookups made (each a round trip on a remote mount)",
    "lookup_known_blocks": "Blocks a lookup answered as stored without asking the store (found or confirmed stored in the last 30 s)",
    "chunk_ref_hit_blocks": "Chunk blocks found as references to stored exact blocks (and read from those)",
    "chunk_refs_stored": "Chunk blocks stored as references to their prompt's exact blocks instead of a copy of their KV",
    "chunk_refs_failed": "Chunk block references the store did not write",
    "sightings_stored": "Prompt segments (chunks, suffixes) computed for the first time: a sighting recorded instead of their KV (admission)",
    "sightings_failed": "Sightings the store did not write",
    "blocks_not_admitted": "Computed prompt blocks not stored: the first sighting of their segment (admission second_sighting)",
    "lookup_timeout_blocks": "Blocks a store lookup did not answer within lookup_timeout_s (misses: computed in full)",
    "store_down_blocks": "Blocks looked up, loaded or dumped while the store counted as down after a deadline passed (down_backoff_s): misses and refusals without IO, computed in full",
    # worker
    "loaded_blocks": "Blocks loaded from the store (exact prefix and chunk)",
    "failed_blocks": "Blocks that could not be loaded and were recomputed",
    "background_loads": "Requests whose exact prefix was read between steps while the others ran (async_prefix_loads)",
    "shared_reads": "Chunk blocks of a step whose stored block another of its chunk blocks read: read once for both",
    "prefetched_blocks": "Chunk blocks read while their blend request waited in the queue, taken by its step (prefetch_chunks)",
    "load_timeout_blocks": "Blocks whose store load passed load_timeout_s (counted in failed_blocks; recomputed)",
    "blend_errors": "Steps whose load, rotation or Blend forward raised (their requests computed by vLLM instead)",
    "dump_errors": "Steps whose dumps raised (nothing of the step stored)",
    "dump_timeout_blocks": "Blocks whose store dump passed dump_timeout_s (not waited for; recomputed if not stored)",
    "load_bytes": "Bytes loaded from the store",
    "load_seconds": "Seconds spent loading and placing KV before the forward",
    "load_wait_seconds": "Of load_seconds, the seconds the worker waited for the store's reads",
    "layerwise_blocks": "Chunk blocks of Blend steps read layer group by layer group while the forward ran (use_layerwise)",
    "layerwise_wait_seconds": "Seconds Blend forwards waited for later layers' chunk KV (use_layerwise): the load time not hidden",
    "dumped_blocks": "Blocks handed to the store",
    "dump_seconds": "Seconds the worker spent gathering KV for dumps and handing it to the store, after the forward",
    "dumps_dropped": "Blocks not handed to the store because its queue of unwritten dumps was full (dump_queue_mb)",
    "dumps_refused": "Blocks not handed to the store because their KV could not be trusted (a failed load of their request, or a Blend region the forward did not run)",
    "dump_bytes": "Bytes handed to the store",
    "recomputed_tokens": "Loaded chunk tokens recomputed from the check layer on",
    "narrowed_tokens": "Of recomputed_tokens, those dropped at a later check layer (gradual filtering): their loaded KV kept from there on",
    "blend_rows": "Rows the Blend forward ran from the check layer on beside vLLM's scheduled ones (misses, question, recomputed tokens)",
    "blend_steps_over_cap": "Steps whose Blend rows exceeded max_step_tokens (the scheduler admits within it: never expected)",
    "reused_tokens": "Loaded chunk tokens that kept their loaded KV from the check layer on",
    "kv_shifted_tokens": "Reused chunk tokens whose KV was moved by their chunk's mean error (kv_shift)",
    "probe_tokens": "Tokens run an extra time through the check layer and the layers after it to rank the loaded tokens",
}


@dataclass
class UCMConnectorStats(KVConnectorStats):
    """`data` maps counter names (COUNTERS) to sums; plain ints and floats, so it pickles."""

    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, value: int | float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown UCM counter {name!r}")
        if value:
            self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> UCMConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.data.items()}
        if self.data.get("load_seconds"):
            out["load_GB_per_s"] = round(self.data.get("load_bytes", 0) / self.data["load_seconds"] / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> UCMConnectorStats | None:
        """This interval's counts (None when nothing happened); counting starts again from zero."""
        if self.is_empty():
            return None
        taken = UCMConnectorStats(data=self.data)
        self.reset()
        return taken


class UCMPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of COUNTERS, labelled per engine like vLLM's own."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:ucm_{name}", documentation=f"UCM: {doc}", labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)


def ucm_counters(metrics=None) -> dict[str, float]:
    """`{name: value}` of the UCM counters, summed over engines: from `LLM.get_metrics()` output, or
    with None from this process's Prometheus registry, where the offline engine's stat logger keeps
    them. Prefer None: get_metrics() truncates counters to ints, zeroing the `*_seconds` ones."""
    out: dict[str, float] = {}
    if metrics is None:
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.type == "counter" and family.name.startswith("vllm:ucm_"):
                key = family.name[len("vllm:ucm_"):]
                out[key] = out.get(key, 0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
        return {k: v for k, v in out.items() if v}
    for m in metrics:
        name = getattr(m, "name", "")
        if name.startswith("vllm:ucm_") and hasattr(m, "value"):
            key = name[len("vllm:ucm_"):]
            out[key] = out.get(key, 0) + m.value
    return out
