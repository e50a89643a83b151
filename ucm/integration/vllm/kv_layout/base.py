"""Read and write the KV of single tokens in one layer's paged vLLM KV cache.

The connector moves KV in a canonical, token-major form: ``k, v: [num_tokens, num_kv_heads,
head_size]``. A token is addressed by its *slot*, ``block_id * block_size + offset``, the same
numbering as vLLM's ``slot_mapping``. Two physical layouts are supported (vLLM 0.32):

``CPU_ATTN`` (:class:`CpuKVLayout`)
    vLLM hands the connector one contiguous ``[num_blocks, H, block_size, 2 * D]`` tensor per
    layer (``KVCacheLayout.LBHNC``, the only layout this backend accepts), but the attention
    kernel does not use that shape as it reads: it views it as ``[num_blocks, H, 2 * block_size,
    D]`` and chunks dim 2. For the ``vec``/``vec16`` ISAs, each ``(block, head)`` page of
    ``2 * block_size * D`` elements holds K *transposed*, ``[D, block_size]`` (``K[t, d]`` at
    ``d * block_size + t``), followed by V token-major, ``[block_size, D]`` (``V[t, d]`` at
    ``block_size * D + t * D + d``). The ``amx`` ISA (bfloat16 with AMX and ``block_size % 32 ==
    0``) packs both into VNNI tiles instead (K in 16-token tiles of interleaved d pairs, V in
    16-column tiles of interleaved token pairs); that page is a fixed bijection of ``(t, d)``,
    which the layout reads off vLLM's own write op once per geometry (:func:`_page_map`) and
    gathers/scatters through. Verified bit-exact against
    ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (see ``tests/unit/integration``).

``FLASH_ATTN`` (:class:`FlashKVLayout`)
    vLLM hands a *logical* ``[num_blocks, H, block_size, 2 * D]`` view whose strides follow the
    resolved ``KVCacheLayout`` (default ``LBNHC``: physical ``[num_blocks, block_size, H, 2 * D]``;
    block-outermost layouts interleave the layers' pages, so the view need not be contiguous).
    FlashAttention reads it as ``kv_cache.transpose(1, 2).split(D, dim=-1)``: K is
    ``[..., :D]`` and V is ``[..., D:]``. Plain strided indexing on the logical view is correct
    for every stride order, on any device.

When vLLM splits a KV-manager block into several smaller kernel blocks, the tensor's dim 2 is the
kernel block size; slots are unaffected (kernel blocks of a manager block are consecutive), and
``gather_blocks``/``scatter_blocks`` take manager block ids (``block_size``) and expand them.

Slots must be valid (``0 <= slot < num_blocks * kernel_block_size``; vLLM's padding slot ``-1`` is
not skipped) and a scatter must not name a slot twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def slots_for_positions(
    block_ids: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots of the tokens at ``positions`` of a request whose block table is ``block_ids``.

    ``block_ids[i]`` holds the request's positions ``[i * block_size, (i + 1) * block_size)``.
    Returns a LongTensor shaped like ``positions``, on ``block_ids``' device.
    """
    block_ids = torch.as_tensor(block_ids, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long, device=block_ids.device)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("positions must be non-negative")
    return block_ids[positions // block_size] * block_size + positions % block_size


def _all_slots(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every slot of ``block_ids``, block by block."""
    offsets = torch.arange(block_size, device=block_ids.device)
    return (block_ids.reshape(-1, 1) * block_size + offsets).reshape(-1)


def _page_runs(slots: torch.Tensor, page_size: int) -> list[tuple[int, int, int, int]]:
    """``(index, page, offset, length)`` of each run of ``slots`` that are consecutive within one
    page, in order: ``slots[index:index + length]`` are ``page * page_size + offset + range(length)``."""
    if slots.numel() == 0:
        return []
    s = slots.tolist()
    runs, start = [], 0
    for i in range(1, len(s) + 1):
        if i == len(s) or s[i] != s[i - 1] + 1 or s[i] % page_size == 0:
            runs.append((start, s[start] // page_size, s[start] % page_size, i - start))
            start = i
    return runs


class KVLayout(ABC):
    """Token-level access to one layer's paged KV cache. Stateless apart from its geometry."""

    backend_name: str = ""

    def __init__(
        self,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        kernel_block_size: int | None = None,
    ) -> None:
        kernel_block_size = block_size if kernel_block_size is None else kernel_block_size
        if min(block_size, num_kv_heads, head_size, kernel_block_size) <= 0:
            raise ValueError("block_size, num_kv_heads and head_size must be positive")
        if block_size % kernel_block_size:
            raise ValueError(
                f"kernel block size {kernel_block_size} does not divide block size {block_size}"
            )
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kernel_block_size = kernel_block_size

    # ---------------------------------------------------------------- public API

    @abstractmethod
    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of ``slots``: two contiguous ``[n, H, D]`` tensors."""

    @abstractmethod
    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes ``k, v: [n, H, D]`` into ``slots`` of ``kv_cache``, in place."""

    def page_grid(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel blocks holding ``slots``, sorted; each slot's row in the ``[blocks x
        kernel_block_size]`` token grid of those pages) for `add_pages`."""
        b, o = self._split_slots(self._slots(slots, slots.device))
        blocks, page = torch.unique(b, return_inverse=True)
        return blocks, page * self.kernel_block_size + o

    def add_pages(self, kv_cache: torch.Tensor, kernel_blocks: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor) -> None:
        """Adds ``dk, dv: [blocks x kernel_block_size, H, D]`` (the `page_grid` rows) to the K and
        V of those pages, in place (the KV shift)."""
        slots = (kernel_blocks.reshape(-1, 1) * self.kernel_block_size
                 + torch.arange(self.kernel_block_size, device=kernel_blocks.device)).reshape(-1)
        k, v = self.gather(kv_cache, slots)
        self.scatter(kv_cache, slots, k.float() + dk.float(), v.float() + dv.float())

    def gather_layers_into(self, kv_caches: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
        """The K and V of ``slots`` in every layer, written into ``out: [n, layers, 2, H, D]`` (the
        store's token-major block form) without temporaries where the layout allows."""
        for layer, cache in enumerate(kv_caches):
            out[:, layer, 0], out[:, layer, 1] = self.gather(cache, slots)

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of ``block_ids``: ``[len(block_ids) * block_size, H, D]``,
        blocks in the given order, tokens in order within each block."""
        self._check(kv_cache)
        kb = self._kernel_blocks(block_ids, kv_cache.device)
        if kb.numel() == 0:
            return self._empty(kv_cache), self._empty(kv_cache)
        return self._gather_kernel_blocks(kv_cache, kb)

    def gather_pages_head_major(
        self, kv_cache: torch.Tensor, kernel_block_ids: torch.Tensor, values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K transposed ``[H, D, n]`` and V ``[H, n, D]`` of every token of the kernel blocks
        ``kernel_block_ids`` (the attention metadata's block-table entries), in order: the
        operands of a GEMM-based attention. V is None with ``values=False``."""
        self._check(kv_cache)
        kb = torch.as_tensor(kernel_block_ids, dtype=torch.long).to(kv_cache.device).reshape(-1)
        if kb.numel() == 0:
            empty = self._empty(kv_cache)
            return empty.permute(1, 2, 0), empty.transpose(0, 1) if values else None
        k, v = self._gather_kernel_blocks(kv_cache, kb)
        return k.permute(1, 2, 0).contiguous(), v.transpose(0, 1).contiguous() if values else None

    def scatter_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Writes whole blocks: ``k, v: [len(block_ids) * block_size, H, D]``, token-major."""
        self._check(kv_cache)
        kb = self._kernel_blocks(block_ids, kv_cache.device)
        k, v = self._prepare_kv(kv_cache, k, v, kb.numel() * self.kernel_block_size)
        if kb.numel() == 0:
            return
        self._scatter_kernel_blocks(kv_cache, kb, k, v)

    def block_slots(self, block_ids: torch.Tensor) -> torch.Tensor:
        """All slots of ``block_ids``, in ``gather_blocks`` order."""
        return _all_slots(torch.as_tensor(block_ids, dtype=torch.long), self.block_size)

    def num_blocks(self, kv_cache: torch.Tensor) -> int:
        """Number of ``block_size`` blocks ``kv_cache`` holds."""
        return kv_cache.shape[0] * self.kernel_block_size // self.block_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, kernel_block_size={self.kernel_block_size})"
        )

    # ---------------------------------------------------------------- helpers

    @abstractmethod
    def _gather_kernel_blocks(self, kv_cache: torch.Tensor, kb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _scatter_kernel_blocks(
        self, kv_cache: torch.Tensor, kb: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def _check(self, kv_cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.kernel_block_size, 2 * self.head_size)
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != expected:
            raise ValueError(
                f"{type(self).__name__} expects a [num_blocks, {expected[0]}, {expected[1]}, "
                f"{expected[2]}] KV cache (num_kv_heads, block_size, 2 * head_size); got "
                f"{tuple(kv_cache.shape)}"
            )
        if kv_cache.dtype not in _KV_DTYPES:
            raise NotImplementedError(
                f"KV cache dtype {kv_cache.dtype} is not supported (quantized KV caches are not); "
                f"use one of {[str(d) for d in _KV_DTYPES]}"
            )

    def _slots(self, slots: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.long).to(device, non_blocking=True).reshape(-1)

    def _split_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of each slot."""
        return torch.div(slots, self.kernel_block_size, rounding_mode="floor"), slots % self.kernel_block_size

    def _kernel_blocks(self, block_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        block_ids = torch.as_tensor(block_ids, dtype=torch.long).to(device, non_blocking=True).reshape(-1)
        ratio = self.block_size // self.kernel_block_size
        if ratio == 1:
            return block_ids
        return (block_ids.reshape(-1, 1) * ratio + torch.arange(ratio, device=device)).reshape(-1)

    def _empty(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.new_empty((0, self.num_kv_heads, self.head_size))

    def _prepare_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, self.num_kv_heads, self.head_size)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise ValueError(f"k and v must be {list(shape)}; got {list(k.shape)} and {list(v.shape)}")
        k = k.to(device=kv_cache.device, dtype=kv_cache.dtype, non_blocking=True)
        v = v.to(device=kv_cache.device, dtype=kv_cache.dtype, non_blocking=True)
        return k, v
