"""vLLM's FLASH_ATTN cache layout (see the package docstring)."""

from __future__ import annotations

import torch

from ucm.integration.vllm.kv_layout.base import KVLayout


class FlashKVLayout(KVLayout):
    """vLLM ``FLASH_ATTN``: logical ``[num_blocks, H, block_size, 2 * D]``, K = ``[..., :D]``,
    V = ``[..., D:]``, any stride order (see the module docstring). Pure tensor indexing, so it
    runs on CUDA and CPU tensors alike."""

    backend_name = "FLASH_ATTN"

    def gather(self, kv_cache, slots):
        self._check(kv_cache)
        b, o = self._split_slots(self._slots(slots, kv_cache.device))
        d = self.head_size
        # Advanced indices on dims 0 and 2 around a slice: the result is [n, H, D].
        return kv_cache[b, :, o, :d], kv_cache[b, :, o, d:]

    def scatter(self, kv_cache, slots, k, v):
        self._check(kv_cache)
        b, o = self._split_slots(self._slots(slots, kv_cache.device))
        k, v = self._prepare_kv(kv_cache, k, v, b.numel())
        if b.numel() == 0:
            return
        d = self.head_size
        kv_cache[b, :, o, :d] = k
        kv_cache[b, :, o, d:] = v

    def _gather_kernel_blocks(self, kv_cache, kb):
        t = torch.arange(self.kernel_block_size, device=kv_cache.device)
        b, o = kb.reshape(-1, 1), t.reshape(1, -1)
        d = self.head_size
        k = kv_cache[b, :, o, :d]  # [blocks, kernel_block_size, H, D]
        v = kv_cache[b, :, o, d:]
        return k.reshape(-1, self.num_kv_heads, d), v.reshape(-1, self.num_kv_heads, d)

    def _scatter_kernel_blocks(self, kv_cache, kb, k, v):
        t = torch.arange(self.kernel_block_size, device=kv_cache.device)
        b, o = kb.reshape(-1, 1), t.reshape(1, -1)
        d, shape = self.head_size, (kb.numel(), self.kernel_block_size, self.num_kv_heads, self.head_size)
        kv_cache[b, :, o, :d] = k.reshape(shape)
        kv_cache[b, :, o, d:] = v.reshape(shape)
