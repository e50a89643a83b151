"""What this CPU and this vLLM build can run, found by calling the ops (never by reading CPU flags).

vLLM's CPU cache-write op packs bfloat16 pages in AMX's VNNI tiles (ISA ``amx``) only where its
build supports that configuration on the running CPU; on CPUs with AVX-512F alone it raises
"Unsupported CPU attention configuration". The layout code and the native kernel read AMX pages
with plain loads, so they stay testable there: the tests then write AMX pages with
:func:`amx_reference_write`, the VNNI tiling spelled out, which ``test_cpu_amx_page_map`` checks
against vLLM's op wherever the op runs.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def amx_write_unsupported() -> str | None:
    """None if vLLM's write op packs AMX pages on this CPU, else why not (the op's own error).

    ``UCM_TESTS_REFUSE_AMX_WRITE=1`` takes the path of a CPU that refuses, on any host.
    """
    if os.environ.get("UCM_TESTS_REFUSE_AMX_WRITE") == "1":
        return "UCM_TESTS_REFUSE_AMX_WRITE=1"
    from ucm.integration.vllm.kv_layout.cpu import _vllm_cpu_reshape_and_cache

    op = _vllm_cpu_reshape_and_cache()
    if op is None:
        return "this vLLM build has no cpu_attn_reshape_and_cache"
    bs, d = 32, 64
    cache = torch.zeros(1, 1, 2 * bs, d, dtype=torch.bfloat16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    k = torch.ones(bs, 1, d, dtype=torch.bfloat16)
    try:
        op(k, k, key_cache, value_cache, torch.arange(bs), "amx")
    except RuntimeError as exc:
        return f"vLLM's cpu_attn_reshape_and_cache refuses ISA 'amx' on this CPU: {exc}"
    return None


def amx_page_map_reference(block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page offsets of ``K[t, d]`` and ``V[t, d]`` in vLLM 0.32's AMX page: K in 16-token tiles, d
    pairs interleaved per token; V after all of K, in 16-column tiles, token pairs interleaved."""
    t, d = torch.arange(block_size)[:, None], torch.arange(head_size)[None, :]
    k_map = (t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2
    v_map = block_size * head_size + (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return k_map, v_map


def amx_reference_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """What ``cpu_attn_reshape_and_cache(..., isa="amx")`` writes, in plain torch.

    ``key_cache``/``value_cache`` are the halves of ``cache.view(B, H, 2 * bs, D).chunk(2, dim=2)``,
    as vLLM's backend passes them; each (block, head) page is the ``2 * bs * D`` elements from K's
    half on.
    """
    num_blocks, heads, bs, d = key_cache.shape
    pages = key_cache.as_strided((num_blocks, heads, 2 * bs * d), (heads * 2 * bs * d, 2 * bs * d, 1),
                                 key_cache.storage_offset())
    k_map, v_map = amx_page_map_reference(bs, d)
    slots = slot_mapping.long()
    b, o = (slots // bs)[:, None, None], slots % bs
    h = torch.arange(heads)[None, :, None]
    pages[b, h, k_map[o][:, None, :]] = key.to(pages.dtype)
    pages[b, h, v_map[o][:, None, :]] = value.to(pages.dtype)


def cache_write_op(op):
    """``op`` where it packs AMX pages on this CPU; elsewhere ``op`` with ISA ``amx`` answered by
    :func:`amx_reference_write` (every other ISA still goes to ``op``)."""
    if op is None or amx_write_unsupported() is None:
        return op

    def write(key, value, key_cache, value_cache, slot_mapping, isa, *args, **kwargs):
        if isa == "amx":
            return amx_reference_write(key, value, key_cache, value_cache, slot_mapping)
        return op(key, value, key_cache, value_cache, slot_mapping, isa, *args, **kwargs)

    return write
