"""Delta-RoPE on the worker: stored K moved to the positions its chunk now holds, in place.

A chunk's KV is stored at chunk-local positions; placed at another offset (or dumped from one),
its K is rotated by the difference. The rotation tables are the model's own (vLLM's `get_rope`
with the model's rope parameters), built once per worker and shared with the Blend forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ucm.sparse.blend.rope import check_rope_supports_delta, rotate_keys, signed_cos_sin_cache, signed_positions


def _fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass
class KeyRotation:
    cos_sin: torch.Tensor  # float32 [max_position, rotary_dim]: cos then sin halves
    is_neox: bool
    rotary_dim: int
    # A float32 scratch of the given shape for half-precision keys: the worker hands in one of its
    # reused buffers (WorkerSide._reused), since a fresh copy per load costs page faults.
    work_rows: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = _fresh

    @classmethod
    def for_model(cls, vllm_config, work_rows: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = _fresh
                  ) -> KeyRotation:
        """The model's rotation tables in float32; a RoPE that deltas cannot move is refused
        (check_rope_supports_delta names it)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        hf = vllm_config.model_config.hf_text_config
        rope_parameters = getattr(hf, "rope_parameters", None)
        check_rope_supports_delta(rope_parameters)
        head_size = vllm_config.model_config.get_head_size()
        with set_current_vllm_config(vllm_config):
            rope = get_rope(head_size, max_position=vllm_config.model_config.max_model_len,
                            rope_parameters=rope_parameters, is_neox_style=True, dtype=torch.float32)
        return cls(rope.cos_sin_cache.float(), rope.is_neox_style, rope.rotary_dim, work_rows)

    def shift_(self, k: torch.Tensor, delta: torch.Tensor) -> None:
        """Rotate K of several layers ([tokens, layers, H, D]) by per-token deltas, in place.

        vLLM's fused rotary kernel does it for all layers in one pass right in the staging
        buffer: each (token, layer) is a row of H heads, rows a fixed stride apart, token by token
        or (the stored blocks' layer-major form) layer by layer. The kernel
        reads rotations at non-negative positions only: a chunk that moved to an earlier position
        (negative delta, half the chunks of a reordered prompt) reads the sin-negated half of
        `signed_cos_sin_cache`. Half-precision keys are rotated in a float32 copy (float32
        cos/sin, one rounding). Other cases (a partial rotary width) go through rotate_keys.
        """
        num_tokens, num_layers, heads, head_size = k.shape
        if k.device.type == "cpu" and num_tokens > 0 and self.rotary_dim == head_size:
            from vllm import _custom_ops as ops

            heads_packed = k.stride(3) == 1 and k.stride(2) == head_size
            layer_major = heads_packed and (num_layers == 1 or k.stride(1) == num_tokens * k.stride(0))
            work = k
            if k.dtype != self.cos_sin.dtype or not (
                    layer_major or (heads_packed and k.stride(0) == num_layers * k.stride(1))):
                work, layer_major = self.work_rows(tuple(k.shape), self.cos_sin.dtype).copy_(k), False
            row_stride = work.stride(0) if layer_major else work.stride(1)
            rows = work.as_strided((num_tokens * num_layers, heads * head_size), (row_stride, 1))
            positions = signed_positions(delta, self.cos_sin.shape[0])
            positions = positions.repeat(num_layers) if layer_major else positions.repeat_interleave(num_layers)
            ops.rotary_embedding(positions, rows, None, head_size, self.signed_cos_sin, self.is_neox)
            if work is not k:
                k.copy_(work)
            return
        rotated = rotate_keys(k.reshape(num_tokens, num_layers * heads, head_size), delta, self.cos_sin,
                              self.is_neox, self.rotary_dim)
        k.copy_(rotated.view(num_tokens, num_layers, heads, head_size))

    @functools.cached_property
    def signed_cos_sin(self) -> torch.Tensor:
        """The cos/sin cache, then its rows with sin negated (rotations backwards)."""
        return signed_cos_sin_cache(self.cos_sin)
