"""Attention metadata for a subset of a step's tokens, for vLLM's own attention backend.

Selected tokens sit at scattered positions; each maximal run of consecutive positions becomes a
pseudo-request that attends to its request's whole paged KV up to its own position (the kernel's
bottom-right causal alignment), so attention is exactly causal and skips keys after each query.
"""

from __future__ import annotations

import dataclasses

import torch

from ucm.sparse.blend.runs import PseudoBatch


def subset_metadata(meta, pseudo: PseudoBatch, slot_mapping: torch.Tensor, attn_layer, dtype: torch.dtype):
    """A copy of the step's attention metadata that covers only `pseudo`'s tokens."""
    name = type(meta).__name__
    if name == "CPUAttentionMetadata":
        return _cpu_subset(meta, pseudo, slot_mapping, attn_layer, dtype)
    raise NotImplementedError(
        f"Blend's sparse forward supports vLLM's CPU attention backend so far; this engine uses {name}. "
        "Run without ucm_sparse_config.Blend (prefix offload still works) or on the CPU build."
    )


def _cpu_subset(meta, pseudo: PseudoBatch, slot_mapping: torch.Tensor, attn_layer, dtype: torch.dtype):
    from vllm import _custom_ops as ops
    from vllm import envs

    window = attn_layer.impl.sliding_window  # the CPU impl stores -1 for none
    seq_lens = pseudo.seq_lens
    qsl = pseudo.query_start_loc
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=pseudo.num_runs,
        num_heads=attn_layer.num_heads,
        num_kv_heads=attn_layer.num_kv_heads,
        head_dim=attn_layer.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=window,
        isa=attn_layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=attn_layer.kv_cache_dtype,
    )
    return dataclasses.replace(
        meta,
        num_actual_tokens=pseudo.num_tokens,
        max_query_len=pseudo.max_query_len,
        query_start_loc=qsl,
        max_seq_len=pseudo.max_seq_len,
        seq_lens=seq_lens,
        block_table=meta.block_table.index_select(0, pseudo.run_request),
        slot_mapping=slot_mapping,
        scheduler_metadata=scheduler_metadata,
        causal=True,
        dynamic_causal=None,
        use_sdpa_prefill=False,
        num_decode_tokens=0,
        sdpa_attn_masks=None,
        sdpa_start_loc=None,
    )
