"""Delta-RoPE: move stored keys from chunk-local positions to their new offset.

A chunk's K was stored rotated for positions ``0..len-1``. RoPE is a rotation by
``pos * inv_freq`` per frequency pair, so for RoPE types whose angle is a fixed
linear function of the position, ``R(p + d) = R(d) @ R(p)``: rotating the stored
K by ``d`` equals recomputing it at ``p + d``. The rotation for ``d`` is read from
the model's own ``cos_sin_cache`` (row ``d`` = ``cat(cos(d*f), sin(d*f))``), so
scaled variants (linear, llama3, fixed NTK) come for free; a negative ``d``
uses ``cos(|d|)`` and ``-sin(|d|)``.

Layout conventions follow vLLM's ``RotaryEmbedding``: only the first
``rotary_dim`` channels of each head rotate; neox style pairs channel ``i``
with ``i + rotary_dim/2``, GPT-J style pairs ``2i`` with ``2i+1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Rotation",
    "rotate_keys",
    "check_rope_supports_delta",
    "fp32_cos_sin_cache",
    "SUPPORTED_ROPE_TYPES",
]

# Types whose cache row p is exactly (cos(p*f), sin(p*f)) for a fixed frequency
# vector f, so rotations compose. "ntk" is vLLM's *fixed* NTK scaling (a
# different base), not the dynamic one.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "ntk"})

# Why the others are refused (for error messages).
_UNSUPPORTED_REASONS = {
    "yarn": "its cos/sin cache is scaled by mscale, so cache rows are not pure rotations",
    "deepseek_yarn": "its cos/sin cache is scaled by mscale, so cache rows are not pure rotations",
    "deepseek_llama_scaling": "its cos/sin cache is scaled by mscale",
    "dynamic": "the frequencies depend on the sequence length in the reference model",
    "longrope": "it switches between short and long factors by sequence length",
    "su": "it switches between short and long factors by sequence length",
    "mrope": "positions are multi-dimensional (multimodal RoPE)",
    "bailing_mrope": "positions are multi-dimensional (multimodal RoPE)",
    "openpangu": "positions are multi-dimensional (multimodal RoPE)",
    "mllama4": "it is a 2-D vision RoPE",
    "proportional": "Gemma4's proportional RoPE mixes the two halves",
}


def check_rope_supports_delta(rope_parameters: Mapping[str, Any] | None) -> None:
    """Raise ``ValueError`` unless stored keys of this RoPE can be shifted by rotation.

    Accepts a model's ``rope_parameters`` (vLLM >= 0.12 name, key ``rope_type``)
    or legacy ``rope_scaling`` (key ``type``), also nested per layer type
    (``{"full_attention": {...}, "sliding_attention": {...}}``). ``None`` or an
    empty dict is plain RoPE. Partial rotary (``partial_rotary_factor`` /
    ``rope_dim``) is fine: pass ``rotary_dim`` to :func:`rotate_keys`.
    """
    if rope_parameters is None or len(rope_parameters) == 0:
        return
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"rope_parameters must be a dict or None, got {rope_parameters!r}")
    values = list(rope_parameters.values())
    if all(isinstance(v, Mapping) for v in values):  # nested by layer type
        for sub in values:
            check_rope_supports_delta(sub)
        return

    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type is None:
        rope_type = "default"
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_type must be a string, got {rope_type!r}")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        reason = _UNSUPPORTED_REASONS.get(rope_type, "it is not a known composable RoPE type")
        raise ValueError(
            f"CacheBlend cannot shift stored keys for rope_type={rope_type!r}: {reason}. "
            f"Supported: {sorted(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_parameters.get("mrope_section") or rope_parameters.get("xdrope_section"):
        raise ValueError(
            "CacheBlend cannot shift stored keys for multimodal RoPE (mrope_section "
            "set): positions are multi-dimensional."
        )
    if rope_parameters.get("use_fope"):
        raise ValueError(
            "CacheBlend cannot shift stored keys for Fourier RoPE (use_fope): it has no "
            "position-only cos/sin cache."
        )


def check_delta_bounds(delta: torch.Tensor, max_position: int) -> None:
    """Raises unless every ``|delta|`` has a row in a cos/sin cache of ``max_position`` rows
    (costs a device sync)."""
    max_abs = int(delta.abs().max()) if delta.numel() else 0
    if max_abs >= max_position:
        raise ValueError(f"|delta| up to {max_abs} exceeds the cos/sin cache ({max_position} positions); "
                         "the blended prompt is longer than the model's max position")


def rotate_keys(
    k: torch.Tensor,
    delta: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
    rotary_dim: int | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Return a new tensor: ``k`` (``[n, heads, head_size]``) rotated by ``delta[n]``.

    The input is left untouched (the caller decides where the result goes, e.g.
    back into the paged cache). Computed in float32 and cast back to
    ``k.dtype``, so bf16 keys are rounded once rather than per operation.
    ``rotary_dim`` defaults to the cache's width; channels beyond it pass
    through. ``check_bounds`` verifies ``|delta| < len(cos_sin_cache)``, which
    costs a device sync; turn it off only when the caller guarantees it.

    Precision note: vLLM stores ``cos_sin_cache`` in the model dtype; for a
    bf16 model pass :func:`fp32_cos_sin_cache` to avoid bf16 cos/sin.
    """
    if k.dim() != 3:
        raise ValueError(f"k must be [num_tokens, num_heads, head_size], got {tuple(k.shape)}")
    if delta.dim() != 1 or delta.shape[0] != k.shape[0]:
        raise ValueError(
            f"delta must be [num_tokens={k.shape[0]}], got {tuple(delta.shape)}"
        )
    if delta.dtype.is_floating_point or delta.dtype == torch.bool:
        raise ValueError(f"delta must be an integer tensor, got {delta.dtype}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim], got {tuple(cos_sin_cache.shape)}"
        )
    cache_dim = cos_sin_cache.shape[1]
    rotary_dim = cache_dim if rotary_dim is None else rotary_dim
    if rotary_dim != cache_dim or rotary_dim % 2 or rotary_dim > k.shape[-1]:
        raise ValueError(
            f"rotary_dim={rotary_dim} must be even, <= head_size={k.shape[-1]} and "
            f"equal to the cache width {cache_dim}"
        )
    if k.shape[0] == 0:
        return k.clone()

    if check_bounds:
        check_delta_bounds(delta, cos_sin_cache.shape[0])

    return Rotation.of(delta, cos_sin_cache, is_neox_style).apply(k)


@dataclass(frozen=True)
class Rotation:
    """Per-token rotations read once from a cos/sin cache and applied to any number of tensors
    (the KV shift rotates errors by the same positions at every layer)."""

    cos: torch.Tensor  # [n, 1, rotary_dim / 2] float32
    sin: torch.Tensor
    is_neox_style: bool

    @classmethod
    def of(cls, delta: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox_style: bool) -> Rotation:
        """Rotations by ``delta[n]`` (integers, negative ones backwards); no bounds check."""
        abs_delta = delta.abs().to(device=cos_sin_cache.device, dtype=torch.long)
        cos_sin = cos_sin_cache.index_select(0, abs_delta).to(device=delta.device, dtype=torch.float32)
        cos, sin = cos_sin.chunk(2, dim=-1)  # [n, rotary_dim / 2] each
        sign = torch.where(delta < 0, -1.0, 1.0).to(dtype=torch.float32)
        return cls(cos[:, None, :], (sin * sign[:, None])[:, None, :], is_neox_style)

    def apply(self, k: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``k`` (``[n, heads, head_size]``) rotated, in ``k.dtype``; channels past
        the rotary width pass through."""
        if k.shape[0] == 0:
            return k.clone()
        half = self.cos.shape[-1]
        x = k[..., :2 * half].float()
        if self.is_neox_style:
            x1, x2 = x[..., :half], x[..., half:]
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        out = k.clone()
        o1, o2 = (out[..., :half], out[..., half:2 * half]) if self.is_neox_style else (out[..., 0:2 * half:2],
                                                                                        out[..., 1:2 * half:2])
        o1.copy_(x1 * self.cos - x2 * self.sin)
        o2.copy_(x2 * self.cos + x1 * self.sin)
        return out


def fp32_cos_sin_cache(rotary_emb: torch.nn.Module) -> torch.Tensor:
    """A float32 cos/sin cache for a vLLM rotary embedding module.

    vLLM keeps ``cos_sin_cache`` in the model dtype (and ``forward_native``
    may recast the buffer in place), so it is bf16 for bf16 models. The module's
    ``_compute_cos_sin_cache()`` rebuilds the fp32 table (duck-typed, so no
    vLLM import); falls back to the stored buffer when that is unavailable.
    """
    compute = getattr(rotary_emb, "_compute_cos_sin_cache", None)
    buf = rotary_emb.cos_sin_cache
    if compute is None:
        return buf.float()
    return compute().to(device=buf.device, dtype=torch.float32)


def signed_cos_sin_cache(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``[2 * max_position, rotary_dim]``: the cache, then the same rows with sin negated (a
    rotation by -d is cos(d), -sin(d)). With `signed_positions`, a kernel that only reads
    rotations at non-negative positions (vLLM's fused rotary op) rotates backwards too."""
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    return torch.cat([cos_sin_cache, torch.cat([cos, -sin], dim=-1)])


def signed_positions(delta: torch.Tensor, max_position: int) -> torch.Tensor:
    """Rows of `signed_cos_sin_cache` for rotations by ``delta``: d for d >= 0, max_position - d
    for d < 0. Raises where ``|delta|`` passes the cache."""
    check_delta_bounds(delta, max_position)
    return torch.where(delta >= 0, delta, max_position - delta)
