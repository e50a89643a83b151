"""KeyRotation.shift_ on the block forms the worker holds: token-major tensors, the token-major
view of layer-major storage (the stored form), and one layer of it; each equal to rotate_keys."""

from __future__ import annotations

import pytest
import torch

from ucm.integration.vllm.connector.key_rotation import KeyRotation
from ucm.sparse.blend.rope import rotate_keys

T, L, H, D = 7, 3, 2, 16


def _cos_sin(max_pos: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["token_major", "layer_major", "one_layer"])
def test_shift_matches_rotate_keys_in_every_block_form(dtype, form):
    gen = torch.Generator().manual_seed(3)
    rotation = KeyRotation(_cos_sin(256), True, D)
    delta = torch.tensor([5, -3, 0, 17, -7, 40, 1])
    if form == "token_major":
        kv = torch.randn((T, L, 2, H, D), generator=gen).to(dtype)
    else:
        kv = torch.randn((L, T, 2, H, D), generator=gen).to(dtype).transpose(0, 1)
    k = kv[:, :, 0] if form != "one_layer" else kv[:, 1:2, 0]
    want = rotate_keys(k.float().reshape(T, -1, D), delta, rotation.cos_sin, True, D).view(k.shape)
    v_before = kv[:, :, 1].clone()
    rotation.shift_(k, delta)
    torch.testing.assert_close(k.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kv[:, :, 1], v_before)  # V untouched
