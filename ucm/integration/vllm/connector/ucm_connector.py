"""UCMConnector: vLLM's public KV connector API in front of a UCM store, with Blend chunk reuse.

Use it by module path (`kv_connector="UCMConnector"`,
`kv_connector_module_path="ucm.integration.vllm.connector.ucm_connector"`) or, once the package is
installed, by name alone: the `vllm.general_plugins` entry point registers it.
"""

from __future__ import annotations

import dataclasses

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm.config import BlendConfig, UCMConfig
from ucm.integration.vllm.connector.blend_first_scheduler import QUALNAME as BLEND_FIRST, is_blend_first
from ucm.integration.vllm.connector.metadata import UCMConnectorMetadata, UCMWorkerReport
from ucm.integration.vllm.connector.model_identity import model_digest, runtime_identity
from ucm.integration.vllm.connector.scheduler_side import SchedulerSide
from ucm.integration.vllm.connector.stats import UCMConnectorStats, UCMPromMetrics
from ucm.integration.vllm.blend_step import BlendStep
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.integration.vllm.plugin import share_vllm_logging
from ucm.integration.vllm.vllm_names import needs_for, require
from ucm.sparse.blend.rope import check_rope_supports_delta
from ucm.store.factory import create_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Architectures whose forward ucm.integration.vllm.blend.models can blend.
BLEND_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def store_namespace(vllm_config: VllmConfig) -> bytes:
    """Identity of the KV bytes: same model weights, dtype and geometry -> same namespace.

    vLLM's block hashes cover tokens only, so without this two models sharing a store directory
    would read each other's KV. The model is identified by content (`model_digest`: config.json
    and weight files, see model_identity.py), never by its path or served name: two fine-tunes in
    directories of the same name get different namespaces, one model mounted at different paths
    (or served under different names) shares its KV. Dummy weights (load_format "dummy", seeded
    random values whatever the files hold) are marked apart from the real ones, and so are a
    quantization method and config overrides given at run time (`runtime_identity`). Architecture
    and shape follow. v1 named the model by its directory; v2 stored blocks token-major; v3 stores
    them layer-major (one segment per layer): no version finds another's blocks.
    """
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    cache = vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    digest = model_digest(str(mc.model), getattr(mc, "revision", None), getattr(load, "download_dir", None))
    dummy = ":dummy" if str(getattr(load, "load_format", "auto")) == "dummy" else ""
    parts = [
        "ucm-blend/v3",
        f"model:{digest}{dummy}",
        ",".join(getattr(mc.hf_config, "architectures", None) or []),
        f"L{hf.num_hidden_layers}", f"H{mc.get_total_num_kv_heads()}", f"D{mc.get_head_size()}",
        f"V{getattr(hf, 'vocab_size', 0)}", str(mc.dtype), f"kv:{cache.cache_dtype}",
        f"bs{cache.block_size}", f"hash:{cache.prefix_caching_hash_algo}",
        *runtime_identity(mc),
    ]
    return "|".join(parts).encode()


# With Blend on, a running long prefill leaves 1/HOL_RESERVE_DIVISOR of vLLM's step budget to the
# requests behind it (docs/serving.md, "Head-of-line blocking").
HOL_RESERVE_DIVISOR = 8


def leave_room_for_blend(scheduler_config) -> int | None:
    """Sets vLLM's long_prefill_token_threshold to the budget less a reserve, when the user left it 0.

    A blend request whose region is loaded needs one scheduled token, but vLLM's FCFS chunked
    prefill hands the whole step budget to the running prefill in front of it, so the blend
    request waits for that whole prefill (seconds per 2k tokens on CPU). Capping every prefill's
    share of a step at budget - budget/8 lets the next blend request in at the next step, at the
    cost of an eighth of a step for the long prefill. vLLM applies the threshold only when more
    than one request is queued or running. A value the user set (--long-prefill-token-threshold)
    is kept; setting it to max_num_batched_tokens turns this off. Returns the value set, or None.
    """
    if scheduler_config.long_prefill_token_threshold:
        return None
    budget = scheduler_config.max_num_batched_tokens
    threshold = budget - max(1, budget // HOL_RESERVE_DIVISOR)
    if threshold < 1:
        return None
    scheduler_config.long_prefill_token_threshold = threshold
    return threshold


def validate_blend_model(blend: BlendConfig, vllm_config: VllmConfig) -> None:
    mc = vllm_config.model_config
    archs = getattr(mc.hf_config, "architectures", None) or []
    if not any(a in BLEND_ARCHITECTURES for a in archs):
        raise ValueError(f"ucm_sparse_config.Blend does not support model architecture {archs} of {mc.model}; "
                         f"supported: {', '.join(BLEND_ARCHITECTURES)}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("ucm_sparse_config.Blend does not support pipeline parallelism "
                         f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})")
    hf = mc.hf_text_config
    blend.validate_for_model(hf.num_hidden_layers, hf.vocab_size)
    check_rope_supports_delta(getattr(hf, "rope_parameters", None))


def require_vllm_names(vllm_config: VllmConfig, worker: bool, blend: bool) -> None:
    """Refuses at start-up what this vLLM lacks the names for (vllm_names.py): the connector, or
    Blend alone (a prefix-only config is probed for the connector's own names only)."""
    needs = needs_for(blend, worker, lora=getattr(vllm_config, "lora_config", None) is not None,
                      tensor_parallel=vllm_config.parallel_config.tensor_parallel_size > 1)
    require(needs, getattr(vllm_config.model_config.hf_config, "architectures", None) or [])


def _tokenizer_of(model_config):
    """The model's tokenizer as a text -> ids function (no special tokens): a text chunk
    separator is tokenized once, when the scheduler starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                              trust_remote_code=model_config.trust_remote_code)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


class UCMConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        share_vllm_logging()  # vLLM's logging is configured by now: follow its --log-level
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.ucm_config = UCMConfig.from_extra_config(extra)
        if len(self.ucm_config.stores) > 1:
            logger.warning("ucm_connectors lists %d stores; only the first (%s) is used",
                           len(self.ucm_config.stores), self.ucm_config.stores[0].name)
        blend = self.ucm_config.sparse
        if blend is not None:
            validate_blend_model(blend, vllm_config)
        require_vllm_names(vllm_config, role == KVConnectorRole.WORKER, blend is not None)
        spec = self.ucm_config.stores[0]
        self.store = create_store(spec.name, spec.config)
        cache = vllm_config.cache_config
        if cache.prefix_caching_hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            logger.warning("prefix_caching_hash_algo=%s uses a random per-process seed unless PYTHONHASHSEED "
                           "is set: stored KV will not be found by other engine processes",
                           cache.prefix_caching_hash_algo)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if blend is not None and isinstance(blend.chunk_separator, str):
                blend = blend.with_separator_ids(_tokenizer_of(vllm_config.model_config))
                self.ucm_config = dataclasses.replace(self.ucm_config, sparse=blend)
            # The store is a cache: a block that cannot be loaded is recomputed, never an error.
            # The scheduler reads this right after creating the connector.
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("UCMConnector sets kv_load_failure_policy='recompute': a store miss is recomputed")
                vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(
                self.ucm_config, self.store, store_namespace(vllm_config), cache.block_size,
                cache.prefix_caching_hash_algo, vllm_config.scheduler_config.max_num_batched_tokens,
                num_shards=vllm_config.parallel_config.tensor_parallel_size,
                kv_role=vllm_config.kv_transfer_config.kv_role)
            # BlendFirstScheduler admits blend requests ahead of running prefills itself: there a
            # threshold would only slow every prefill that shares its steps (docs/serving.md).
            if (blend is not None and self._scheduler.loads
                    and not is_blend_first(vllm_config.scheduler_config.scheduler_cls)):
                threshold = leave_room_for_blend(vllm_config.scheduler_config)
                if threshold is not None:
                    logger.info("UCMConnector sets long_prefill_token_threshold=%d (max_num_batched_tokens less "
                                "1/%d): a long prefill no longer holds back blend requests behind it; "
                                "--long-prefill-token-threshold overrides it", threshold, HOL_RESERVE_DIVISOR)
                logger.info("Blend runs with scheduler %s: blend requests wait behind running prefills; "
                            "--scheduler-cls %s admits them first (docs/serving.md)",
                            vllm_config.scheduler_config.scheduler_cls or "vLLM's default", BLEND_FIRST)
        else:
            try:
                self._worker = WorkerSide(
                    vllm_config, self.store, blend.check_layer if blend else None,
                    blend.step_cap(vllm_config.scheduler_config.max_num_batched_tokens) if blend else None,
                    blend.later_checks if blend else (), layerwise=self.ucm_config.use_layerwise)
            except Exception:
                self.store.close()
                raise
        logger.info("UCMConnector (%s): store %s %s, blend %s", role.name, spec.name, spec.config, blend)

    # ---- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        self._worker.check_blend_forward()  # the model is built by now

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, UCMConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a step's loads finish in start_load_kv, before the forward; exact prefixes alone between steps

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are gathered after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, UCMConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        self._worker.forget(finished_req_ids)
        return None, self._worker.received() or None

    def build_connector_worker_meta(self) -> UCMWorkerReport | None:
        return self._worker.build_report() if self._worker else None

    def take_blend_step(self) -> BlendStep | None:
        """For the Blend model forward of this step (worker process)."""
        return self._worker.take_blend_step() if self._worker else None

    def blend_forward_failed(self, exc: BaseException) -> None:
        """The Blend forward of this step raised (worker process): vLLM computes its requests."""
        if self._worker is not None:
            self._worker.blend_forward_failed(exc)

    # ---- statistics (both roles) ---------------------------------------------------------

    def get_kv_connector_stats(self) -> UCMConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.stats.take() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UCMConnectorStats:
        return UCMConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> UCMPromMetrics:
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self.store.close()

    # ---- scheduler role ------------------------------------------------------------------

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(report, UCMWorkerReport):
            self._scheduler.take_report(report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.request_finished(request)
