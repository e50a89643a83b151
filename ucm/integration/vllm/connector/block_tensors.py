"""The stored block form as the worker holds it in memory.

A block is stored layer-major, `[layers, tokens, 2 (K, V), kv_heads, head_size]`, one store segment
per layer, so one layer of it can be read and verified alone (layer-wise loading). The worker
indexes blocks token by token: a block tensor is the `[tokens, layers, 2, kv_heads, head_size]`
view (`.transpose(0, 1)`) of layer-major storage. `layer_parts` gives each layer's contiguous rows
of such a view, the destinations of a segment read; `stored_bytes` gives the whole storage.
"""

from __future__ import annotations

import torch


def new_block(num_tokens: int, token_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized block tensor of `num_tokens` (`token_shape`: layers, 2, heads, head size)."""
    layers, *rest = token_shape
    return torch.empty((layers, num_tokens, *rest), dtype=dtype).transpose(0, 1)


def layer_major(block: torch.Tensor) -> torch.Tensor:
    """The layer-major storage a block tensor views; a block of any other form is refused."""
    storage = block.transpose(0, 1)
    if not storage.is_contiguous():
        raise ValueError(f"a block tensor must view layer-major storage; got shape {tuple(block.shape)} "
                         f"strides {block.stride()}")
    return storage


def bytes_view(t: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor (bf16 has no numpy dtype)."""
    if not t.is_contiguous():
        raise ValueError("bytes_view: the tensor is not contiguous")
    return t.view(torch.uint8).numpy().reshape(-1)


def stored_bytes(block: torch.Tensor):
    """A block tensor's bytes in the stored order (layer-major)."""
    return bytes_view(layer_major(block))


def layer_parts(block: torch.Tensor, first: int = 0, end: int | None = None) -> list:
    """The bytes of layers `first..end` of a block tensor, one contiguous view each: the rows of
    a block inside a layer-major staging buffer are contiguous layer by layer, not as a whole."""
    end = block.shape[1] if end is None else end
    return [bytes_view(block[:, layer]) for layer in range(first, end)]
