"""vLLM's CPU_ATTN cache layouts: K transposed then V per (block, head) page for the vec ISAs,
VNNI tiles addressed through a page map read off vLLM's own write op for amx (see the package
docstring)."""

from __future__ import annotations

import functools

import torch

from ucm.integration.vllm.kv_layout.base import KVLayout, _all_slots, _page_runs
from ucm.sparse.blend.tiled_attention import gather_page_runs

# ISAs of vLLM's CPU attention whose cache layout is the transposed-K one.
_TRANSPOSED_K_ISAS = ("vec", "vec16")
# ISAs whose page layout is read off vLLM's write op (_page_map).
_MAPPED_ISAS = ("amx",)


class CpuKVLayout(KVLayout):
    """vLLM ``CPU_ATTN``: with the ``vec``/``vec16`` ISAs, per ``(block, head)``, K transposed
    ``[D, block_size]`` then V ``[block_size, D]``; with ``amx``, VNNI tiles addressed through a
    page map read off vLLM's write op (see the module docstring).

    ``isa`` is the one vLLM's CPU attention uses for this layer (``layer.isa``, chosen by
    ``cpu_attn._get_attn_isa``); ``None`` asks vLLM for it from ``dtype`` (or, when ``dtype`` is
    ``None`` too, from the cache's dtype on first use), falling back to ``vec``/``vec16`` when
    vLLM is not importable.

    ``scatter`` goes through ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (the op vLLM itself
    writes the cache with; faster than tensor indexing) when it is importable and
    ``use_vllm_op`` is not False; otherwise, and for ``gather``, plain tensor indexing.
    """

    backend_name = "CPU_ATTN"

    def __init__(
        self,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        kernel_block_size: int | None = None,
        isa: str | None = None,
        dtype: torch.dtype | None = None,
        use_vllm_op: bool | None = None,
    ) -> None:
        super().__init__(block_size, num_kv_heads, head_size, kernel_block_size=kernel_block_size)
        self.use_vllm_op = use_vllm_op
        self.isa: str | None = None
        # amx: page offsets of K[t, d] and V[t, d], [kernel_block_size, D] each; None for vec.
        self._k_map: torch.Tensor | None = None
        self._v_map: torch.Tensor | None = None
        self._order: torch.Tensor | None = None  # amx: the inverse of both maps (_page_order)
        self._tiled: bool | None = None  # amx: whether the maps are the VNNI tiling (_vnni_tiles)
        if isa is None and dtype is not None:
            isa = _vllm_cpu_isa(dtype, self.kernel_block_size, head_size)
        if isa is not None:
            self._set_isa(isa)

    def _set_isa(self, isa: str) -> None:
        if isa in _MAPPED_ISAS:
            self._k_map, self._v_map = _page_map(isa, self.kernel_block_size, self.head_size)
        elif isa not in _TRANSPOSED_K_ISAS:
            raise NotImplementedError(
                f"vLLM CPU attention ISA {isa!r} is not supported by CpuKVLayout (only "
                f"{list(_TRANSPOSED_K_ISAS + _MAPPED_ISAS)}, whose cache layouts have been verified)"
            )
        self.isa = isa

    def _resolve_isa(self, kv_cache: torch.Tensor) -> str:
        if self.isa is None:
            self._set_isa(_vllm_cpu_isa(kv_cache.dtype, self.kernel_block_size, self.head_size))
        return self.isa  # type: ignore[return-value]

    def _check(self, kv_cache: torch.Tensor) -> None:
        super()._check(kv_cache)
        if not kv_cache.is_contiguous():
            raise ValueError(
                "CPU_ATTN KV cache must be contiguous per layer (KVCacheLayout LBHNC); got strides "
                f"{kv_cache.stride()}"
            )
        self._resolve_isa(kv_cache)

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kt[b, h, d, t] = K[t, d]`` and ``vv[b, h, t, d] = V[t, d]``, views of ``kv_cache``."""
        nb, h, bs, d = kv_cache.shape[0], self.num_kv_heads, self.kernel_block_size, self.head_size
        page = self._page_view(kv_cache)
        return page[..., : bs * d].view(nb, h, d, bs), page[..., bs * d :].view(nb, h, bs, d)

    def gather(self, kv_cache, slots):
        self._check(kv_cache)
        b, o = self._split_slots(self._slots(slots, kv_cache.device))
        if self._k_map is not None:
            return self._mapped(kv_cache, self._k_map, b, o), self._mapped(kv_cache, self._v_map, b, o)
        kt, vv = self._views(kv_cache)
        # Advanced indices on dims 0 and 3 (K) / 0 and 2 (V) around slices: both [n, H, D].
        return kt[b, :, :, o], vv[b, :, o, :]

    def gather_layers_into(self, kv_caches, slots, out):
        if not kv_caches:
            return
        for cache in kv_caches:
            self._check(cache)
        runs = _page_runs(self._slots(slots, torch.device("cpu")), self.kernel_block_size)
        # The native copy (ucm/sparse/blend/tiled_attention.py): torch's strided copies of the
        # transposed K (vec) or of the tiles (amx) cost several times more.
        if self._k_map is not None:  # amx: natively where the map is the VNNI tiling it reads
            if not (self._vnni_tiles() and gather_page_runs(kv_caches, runs, out, self.kernel_block_size, "amx")):
                super().gather_layers_into(kv_caches, slots, out)
            return
        if gather_page_runs(kv_caches, runs, out, self.kernel_block_size, "vec"):
            return
        # Straight page-to-block copies of each run of consecutive slots (a block's tokens sit in
        # one or two pages): faster than `gather`'s per-token advanced indexing, and no temporaries.
        for layer, cache in enumerate(kv_caches):
            kt, vv = self._views(cache)
            k_out, v_out = out[:, layer, 0], out[:, layer, 1]
            for i, b, o, n in runs:
                k_out[i : i + n].copy_(kt[b, :, :, o : o + n].permute(2, 0, 1))
                v_out[i : i + n].copy_(vv[b, :, o : o + n].transpose(0, 1))

    def add_pages(self, kv_cache, kernel_blocks, dk, dv):
        self._check(kv_cache)
        bs, h, d = self.kernel_block_size, self.num_kv_heads, self.head_size
        if self._k_map is not None:
            # Whole pages, summed in float32 and rounded once, as a gather, add and scatter of every
            # slot would; the shifts enter in page order as strided views where the map is vLLM's
            # VNNI tiling (checked against the map), else by the inverse page map.
            pages = self._page_view(kv_cache)
            sums = pages[kernel_blocks].float()
            if self._vnni_tiles():
                k_page, v_page = sums[..., : bs * d], sums[..., bs * d :]
                k_page.view(-1, h, bs // 16, d // 2, 16, 2).add_(
                    dk.float().view(-1, bs // 16, 16, h, d // 2, 2).permute(0, 3, 1, 4, 2, 5))
                v_page.view(-1, h, d // 16, bs // 2, 16, 2).add_(
                    dv.float().view(-1, bs // 2, 2, h, d // 16, 16).permute(0, 3, 4, 1, 5, 2))
            else:
                kv = torch.cat([dk.float().view(-1, bs, h, d), dv.float().view(-1, bs, h, d)], dim=1)
                sums += kv.permute(0, 2, 1, 3).reshape(-1, h, 2 * bs * d)[:, :, self._page_order(kv_cache.device)]
            pages[kernel_blocks] = sums.to(kv_cache.dtype)
            return
        kt, vv = self._views(kv_cache)
        # Whole pages (K is stored transposed per page): a per-token index costs several times more.
        kt[kernel_blocks] += dk.to(kv_cache.dtype).view(-1, bs, h, d).permute(0, 2, 3, 1)
        vv[kernel_blocks] += dv.to(kv_cache.dtype).view(-1, bs, h, d).transpose(1, 2)

    def _vnni_tiles(self) -> bool:
        """Whether the page map is the VNNI tiling csrc/paged_attention.cpp reads: K[t, d] at
        (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2, V[t, d] after K at (d / 16) * 16 *
        bs + (t / 2) * 32 + (d % 16) * 2 + t % 2."""
        if self._tiled is None:
            bs, d = self.kernel_block_size, self.head_size
            t, dim = torch.arange(bs).view(-1, 1), torch.arange(d).view(1, -1)
            k = (t // 16) * 16 * d + (dim // 2) * 32 + (t % 16) * 2 + dim % 2
            v = bs * d + (dim // 16) * 16 * bs + (t // 2) * 32 + (dim % 16) * 2 + t % 2
            self._tiled = (bs % 32 == 0 and d % 32 == 0 and torch.equal(k, self._k_map.cpu())
                           and torch.equal(v, self._v_map.cpu()))
        return self._tiled

    def _page_order(self, device) -> torch.Tensor:
        """For each offset of a mapped page, the index of its element in K then V of the page's
        tokens in (token, dim) order: the inverse of the page map."""
        if self._order is None or self._order.device != device:
            both = torch.cat([self._k_map.flatten(), self._v_map.flatten()])
            order = torch.empty_like(both)
            order[both] = torch.arange(both.numel())
            self._order = order.to(device)
        return self._order

    def _map_index(self, page_map: torch.Tensor, b: torch.Tensor, o: torch.Tensor, device):
        """Index tuple of ``[n, H, D]`` elements (tokens ``(b, o)``) of the ``[pages, H, P]``
        view, for a mapped (amx) page."""
        page_map = page_map.to(device)
        h = torch.arange(self.num_kv_heads, device=device)
        return b.reshape(-1, 1, 1), h.reshape(1, -1, 1), page_map[o].unsqueeze(1)

    def _mapped(self, kv_cache, page_map, b, o) -> torch.Tensor:
        """``[n, H, D]`` elements of tokens ``(b, o)`` of a mapped page, by one flat index (cheaper
        than three broadcast advanced indices)."""
        pages = self._page_view(kv_cache)
        if not pages.is_contiguous():
            return pages[self._map_index(page_map, b, o, kv_cache.device)]
        h = torch.arange(self.num_kv_heads, device=kv_cache.device)
        flat = (b.reshape(-1, 1, 1) * self.num_kv_heads + h.reshape(1, -1, 1)) * pages.shape[2]
        return pages.reshape(-1)[flat + page_map.to(kv_cache.device)[o].unsqueeze(1)]

    def _page_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.view(kv_cache.shape[0], self.num_kv_heads, -1)

    def scatter(self, kv_cache, slots, k, v):
        self._check(kv_cache)
        slots = self._slots(slots, kv_cache.device)
        k, v = self._prepare_kv(kv_cache, k, v, slots.numel())
        if slots.numel() == 0:
            return
        op = self._op() if self.use_vllm_op is not False else None
        if op is not None:
            nb, h, bs, _ = kv_cache.shape
            # Exactly how CPUAttentionBackendImpl.do_kv_cache_update calls it.
            key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, self.head_size).chunk(2, dim=2)
            # The op takes rows a stride apart (heads packed within a row): staging views go as they are.
            op(_packed_rows(k), _packed_rows(v), key_cache, value_cache, slots, self.isa)
            return
        if self.use_vllm_op:
            raise RuntimeError("use_vllm_op=True but vLLM's cpu_attn_reshape_and_cache is not available")
        b, o = self._split_slots(slots)
        if self._k_map is not None:
            pages = self._page_view(kv_cache)
            pages[self._map_index(self._k_map, b, o, kv_cache.device)] = k
            pages[self._map_index(self._v_map, b, o, kv_cache.device)] = v
            return
        kt, vv = self._views(kv_cache)
        kt[b, :, :, o] = k
        vv[b, :, o, :] = v

    def _gather_kernel_blocks(self, kv_cache, kb):
        b = kb.reshape(-1, 1)
        t = torch.arange(self.kernel_block_size, device=kv_cache.device).reshape(1, -1)
        h, d = self.num_kv_heads, self.head_size
        if self._k_map is not None:
            b, t = b.expand(-1, t.shape[1]).reshape(-1), t.expand(b.shape[0], -1).reshape(-1)
            return self._mapped(kv_cache, self._k_map, b, t), self._mapped(kv_cache, self._v_map, b, t)
        kt, vv = self._views(kv_cache)
        # One gather straight into [blocks, block_size, H, D] (measured faster than copying whole
        # pages and then transposing them).
        return kt[b, :, :, t].reshape(-1, h, d), vv[b, :, t, :].reshape(-1, h, d)

    @property
    def page_format(self) -> str:
        """How :meth:`pages` are laid out: ``"vec"`` (K transposed, then V) or ``"amx"`` (VNNI tiles)."""
        return "amx" if self._k_map is not None else "vec"

    def pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[pages, H, 2 * block_size * D]`` as stored, in :attr:`page_format`."""
        self._check(kv_cache)
        return self._page_view(kv_cache)

    def gather_pages_head_major(self, kv_cache, kernel_block_ids, values=True):
        if self._k_map is not None:
            return super().gather_pages_head_major(kv_cache, kernel_block_ids, values)
        self._check(kv_cache)
        kb = torch.as_tensor(kernel_block_ids, dtype=torch.long).to(kv_cache.device).reshape(-1)
        kt, vv = self._views(kv_cache)
        h, d, m = self.num_kv_heads, self.head_size, kb.numel() * self.kernel_block_size
        # K is stored transposed per page already: one copy each, no per-token transpose.
        k_t = kt[kb].permute(1, 2, 0, 3).reshape(h, d, m)
        return k_t, vv[kb].transpose(0, 1).reshape(h, m, d) if values else None

    def _scatter_kernel_blocks(self, kv_cache, kb, k, v):
        if self._k_map is not None:
            self.scatter(kv_cache, _all_slots(kb, self.kernel_block_size), k, v)
            return
        kt, vv = self._views(kv_cache)
        shape = (kb.numel(), self.kernel_block_size, self.num_kv_heads, self.head_size)
        # Whole pages at once; measured faster than the op or a per-token index_put for float32.
        kt[kb] = k.reshape(shape).permute(0, 2, 3, 1)
        vv[kb] = v.reshape(shape).transpose(1, 2)

    @staticmethod
    def _op():
        return _vllm_cpu_reshape_and_cache()


@functools.cache
def _page_map(isa: str, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's ``cpu_attn_reshape_and_cache`` puts ``K[t, d]`` and ``V[t, d]`` in a
    ``(block, head)`` page for ``isa``: two ``[block_size, D]`` LongTensors of page offsets.

    Read off the op itself, so it is exact by construction for any geometry: K (then V) of one
    full page is written with each element coding its own ``t * D + d``, one base-128 digit per
    pass (bfloat16 holds the integers 1..128 exactly); a zero V (K) marks the other half.
    """
    op = _vllm_cpu_reshape_and_cache()
    if op is None:
        raise NotImplementedError(f"the {isa!r} KV cache layout needs vLLM's cpu_attn_reshape_and_cache op")
    if block_size % 32:
        raise NotImplementedError(f"vLLM's {isa!r} CPU attention needs block_size % 32 == 0; got {block_size}")
    n, base, page = block_size * head_size, 128, 2 * block_size * head_size
    digits = 1
    while base**digits < n:
        digits += 1
    code = torch.arange(n).view(block_size, 1, head_size)
    maps = []
    for half in (0, 1):
        decoded, written = torch.zeros(page, dtype=torch.long), None
        for j in range(digits):
            digit = (code // base**j % base + 1).to(torch.bfloat16)
            kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=torch.bfloat16)
            key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
            k, v = (digit, torch.zeros_like(digit)) if half == 0 else (torch.zeros_like(digit), digit)
            op(k, v, key_cache, value_cache, torch.arange(block_size), isa)
            values = kv.view(-1).long()
            written = values != 0
            decoded += (values - 1).clamp(min=0) * base**j
        offsets = written.nonzero().flatten()
        page_map = torch.full((n,), -1, dtype=torch.long)
        page_map[decoded[offsets]] = offsets
        maps.append(page_map.view(block_size, head_size))
    both = torch.cat([m.flatten() for m in maps])
    if int(both.min()) < 0 or torch.unique(both).numel() != page:
        raise NotImplementedError(f"vLLM's {isa!r} KV page for block_size {block_size}, head_size {head_size} "
                                  "is not a bijection of (token, dim): this layout cannot address it")
    return maps[0], maps[1]


def _packed_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([n, H, D]) if each row's heads are packed, else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


@functools.cache
def _vllm_cpu_reshape_and_cache():
    """vLLM's CPU cache-write op, or None when this vLLM build has none."""
    try:
        from vllm import _custom_ops as ops

        if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
            return None
        return ops.cpu_attn_reshape_and_cache
    except Exception:  # noqa: BLE001 - no vLLM, or a build without the CPU ops
        return None


def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention picks for this geometry (``cpu_attn._get_attn_isa``)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # noqa: BLE001 - no vLLM CPU backend: assume the generic kernels
        return "vec" if block_size % 32 == 0 and head_size % 32 == 0 else "vec16"
    return _get_attn_isa(dtype, block_size, head_size)
