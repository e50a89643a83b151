"""Engine construction with the settings this project needs on every platform.

On CPU: float32 unless overridden (about 3x faster than bfloat16 on CPUs without native
bfloat16; with AVX512-BF16 or AMX, bfloat16 is 1.4-3x faster: pass dtype="bfloat16"), a KV cache size in GiB from
VLLM_CPU_KVCACHE_SPACE (vLLM refuses to start without it on small machines), and vLLM's own
compilation: steps without a Blend region run vLLM's compiled forward, a Blend step runs its layers
eagerly (models.py), so the server computes what Blend cannot help with as fast as plain vLLM
does. Elsewhere eager mode: a captured CUDA graph would replay without Blend's data-dependent
selection (not measured here). `enforce_eager=True` starts faster (no compilation), for
short-lived engines. With Blend on and no scheduler class given, BlendFirstScheduler (it admits
blend requests first).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ucm.config import attn_layer_name

DEFAULT_CPU_KVCACHE_GIB = "4"


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(model: str, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_model_len": 8192,
        "seed": 0,
    }
    if is_cpu_platform():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        kwargs.update(dtype="float32", gpu_memory_utilization=0.5)
    else:
        kwargs.update(enforce_eager=True)
    kwargs.update(overrides)
    from ucm.integration.vllm.connector.blend_first_scheduler import default_scheduler_cls

    scheduler_cls = default_scheduler_cls(kwargs.get("kv_transfer_config"), kwargs.get("scheduler_cls"),
                                          kwargs.get("async_scheduling"))
    if scheduler_cls is not None:
        kwargs["scheduler_cls"] = scheduler_cls
    return kwargs


def make_llm(model: str, **overrides: Any):
    """An `LLM` with project defaults; callers must run under `if __name__ == "__main__":`."""
    from vllm import LLM

    return LLM(**engine_kwargs(model, **overrides))


def ucm_transfer_config(store_dir, blend_ratio: float | None = None, chunk_end_token_id: int | None = 2,
                        check_layer: str = "model.layers.1.self_attn.attn", capacity_gb: float | None = None,
                        chunk_store: str | None = None, kv_shift: float | None = None,
                        store_options: dict[str, Any] | None = None, blend_options: dict[str, Any] | None = None,
                        later_checks: Sequence[tuple[int, float]] = (), async_prefix_loads: bool | str | None = None,
                        layerwise: bool | None = None):
    """KVTransferConfig for the UCM connector on one store directory; Blend when a ratio is given
    (`kv_shift`: the share of the chunk-mean KV shift; None: the config's default; `store_options`:
    more UcmNfsStore keys, such as its timeouts; `blend_options`: more Blend keys; `layerwise`:
    use_layerwise, None: the config's default)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**ucm_transfer_dict(store_dir, blend_ratio, chunk_end_token_id, check_layer, capacity_gb,
                                                chunk_store, kv_shift, store_options, blend_options, later_checks,
                                                async_prefix_loads, layerwise))


def ucm_transfer_dict(store_dir, blend_ratio: float | None = None, chunk_end_token_id: int | None = 2,
                      check_layer: str = "model.layers.1.self_attn.attn", capacity_gb: float | None = None,
                      chunk_store: str | None = None, kv_shift: float | None = None,
                      store_options: dict[str, Any] | None = None,
                      blend_options: dict[str, Any] | None = None,
                      later_checks: Sequence[tuple[int, float]] = (),
                      async_prefix_loads: bool | str | None = None, layerwise: bool | None = None) -> dict[str, Any]:
    """The same as a dict, as `--kv-transfer-config` takes it in JSON (`later_checks`: (layer,
    ratio) of each check layer after the first, CacheBlend's gradual filtering)."""
    store: dict[str, Any] = {"storage_backends": str(store_dir)}
    if capacity_gb is not None:
        store["capacity_gb"] = capacity_gb
    store.update(store_options or {})
    extra: dict[str, Any] = {"ucm_connectors": [{"ucm_connector_name": "UcmNfsStore", "ucm_connector_config": store}]}
    if async_prefix_loads is not None:
        extra["async_prefix_loads"] = async_prefix_loads
    if layerwise is not None:
        extra["use_layerwise"] = layerwise
    if blend_ratio is not None:
        extra["ucm_sparse_config"] = {"Blend": {"chunk_end_token_id": chunk_end_token_id,
                                                "compute_meta": {check_layer: {"ratio": blend_ratio}}}}
        if chunk_store is not None:
            extra["ucm_sparse_config"]["Blend"]["chunk_store"] = chunk_store
        if kv_shift is not None:
            extra["ucm_sparse_config"]["Blend"]["compute_meta"][check_layer]["kv_shift"] = kv_shift
        for layer, ratio in later_checks:
            extra["ucm_sparse_config"]["Blend"]["compute_meta"][attn_layer_name(layer)] = {"ratio": ratio}
        extra["ucm_sparse_config"]["Blend"].update(blend_options or {})
    return {"kv_connector": "UCMConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def shutdown(llm) -> None:
    """Stop an engine's processes now rather than at interpreter exit."""
    import psutil

    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        try:
            core.shutdown()
        except psutil.NoSuchProcess:
            # vLLM 0.32 lists the engine's process tree, then reads each child's name to kill it:
            # a worker that exits in between raises. It is gone, which is what was asked.
            pass
