"""Read and write the KV of single tokens in one layer's paged vLLM KV cache: the layout of each
attention backend (base.py says how tokens are addressed), and `layout_for` to pick one.

Used by the connector (loads and dumps) and by the Blend forward (rows it reads and writes), so
neither imports the other for it.
"""

from __future__ import annotations

import re

import torch

from ucm.integration.vllm.kv_layout.base import KVLayout, slots_for_positions
from ucm.integration.vllm.kv_layout.cpu import CpuKVLayout
from ucm.integration.vllm.kv_layout.flash import FlashKVLayout

__all__ = [
    "KVLayout",
    "CpuKVLayout",
    "FlashKVLayout",
    "layer_index",
    "layout_for",
    "slots_for_positions",
    "SUPPORTED_BACKENDS",
]

_LAYOUTS: dict[str, type[KVLayout]] = {
    CpuKVLayout.backend_name: CpuKVLayout,
    FlashKVLayout.backend_name: FlashKVLayout,
}
SUPPORTED_BACKENDS = tuple(_LAYOUTS)
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The index of an attention layer from its name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ValueError(f"cannot find the layer index in attention layer name {name!r}")
    return int(m.group(1))


def layout_for(
    kv_cache: torch.Tensor,
    backend_name: str,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    **kwargs,
) -> KVLayout:
    """The layout for one layer's ``kv_cache`` (as handed to ``register_kv_caches``) of the
    attention backend named ``backend_name`` (``AttentionBackend.get_name()``, e.g. ``"CPU_ATTN"``
    or ``"FLASH_ATTN"``). ``block_size`` is the KV manager's block size; the kernel block size is
    read from the tensor. Extra keyword arguments go to the layout (e.g. ``isa=`` for CPU)."""
    cls = _LAYOUTS.get(str(backend_name).upper())
    if cls is None:
        raise NotImplementedError(
            f"attention backend {backend_name!r} is not supported by the KV layout adapter; "
            f"supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    if kv_cache.dim() != 4:
        raise ValueError(
            f"{backend_name} KV cache must be a 4-D [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size] tensor; got shape {tuple(kv_cache.shape)}"
        )
    if cls is CpuKVLayout:
        kwargs.setdefault("dtype", kv_cache.dtype)
    layout = cls(block_size, num_kv_heads, head_size, kernel_block_size=kv_cache.shape[2], **kwargs)
    layout._check(kv_cache)
    return layout
