"""Token-level KV access (ucm.integration.vllm.kv_layout) against vLLM's own cache layouts.

CPU_ATTN: caches are written with vLLM's ``cpu_attn_reshape_and_cache`` op, exactly as
``CPUAttentionBackendImpl.do_kv_cache_update`` calls it, and everything is compared bit-exactly.
FLASH_ATTN: no CUDA here, so caches are the logical ``[B, H, N, 2D]`` views vLLM's allocator builds
(``compute_layout_strides`` for every ``KVCacheLayout``) and the reference writes them the way
FlashAttention splits them (``kv_cache.transpose(1, 2).split(D, -1)``), one token at a time.
"""

from __future__ import annotations

import pytest
import torch

from ucm.integration.vllm.kv_layout import (
    SUPPORTED_BACKENDS,
    CpuKVLayout,
    FlashKVLayout,
    KVLayout,
    layout_for,
    slots_for_positions,
)
from ucm.sparse.blend.tiled_attention import NATIVE_ISAS, gather_page_runs

H, D = 3, 64
DTYPES = [torch.float32, torch.bfloat16]


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


def _scattered_slots(num_blocks, block_size, n, gen):
    """n distinct slots spread over all blocks, none of them filled completely (partial blocks)."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    assert (torch.bincount(slots // block_size, minlength=num_blocks) < block_size).all()
    return slots


# ----------------------------------------------------------------------------- helpers


def test_slots_for_positions():
    block_ids = torch.tensor([7, 2, 9])
    positions = torch.tensor([0, 3, 4, 5, 11, 8])
    assert slots_for_positions(block_ids, positions, 4).tolist() == [28, 31, 8, 9, 39, 36]
    with pytest.raises(IndexError):
        slots_for_positions(block_ids, torch.tensor([12]), 4)
    with pytest.raises(ValueError):
        slots_for_positions(block_ids, torch.tensor([-1]), 4)


def test_block_slots_and_num_blocks():
    layout = FlashKVLayout(4, H, D)
    assert layout.block_slots(torch.tensor([3, 1])).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert layout.num_blocks(torch.zeros(5, H, 4, 2 * D)) == 5


# ----------------------------------------------------------------------------- CPU_ATTN



@pytest.fixture
def cpu_op(cache_write):
    return cache_write


def _vllm_write(op, cache, slots, k, v, isa):
    """What CPUAttentionBackendImpl.do_kv_cache_update does."""
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    op(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def _isa(block_size):
    return "vec" if block_size % 32 == 0 else "vec16"


# (block size, dtype, ISA): the vec ISAs for both dtypes, and AMX's VNNI tiles (bfloat16 only). Where
# vLLM's op cannot pack AMX pages on this CPU, the reference tiling writes them (tests/cpu_probes.py).
VEC_CASES = [(bs, dt, _isa(bs)) for bs in (128, 16) for dt in DTYPES]
CPU_CASES = VEC_CASES + [(128, torch.bfloat16, "amx"), (32, torch.bfloat16, "amx")]


def _ids(cases):
    return [f"bs{bs}-{str(dt)[6:]}-{isa}" for bs, dt, isa in cases]


CPU_ARGS = ("block_size", "dtype", "isa")


@pytest.mark.parametrize(CPU_ARGS, VEC_CASES, ids=_ids(VEC_CASES))
def test_cpu_documented_layout(cpu_op, block_size, dtype, isa):
    """The evidence: per (block, head), K transposed [D, bs] then V [bs, D]."""
    gen = torch.Generator().manual_seed(1)
    nb, n = 4, 3 * block_size // 2
    cache = torch.zeros(nb, H, block_size, 2 * D, dtype=dtype)
    slots = _scattered_slots(nb, block_size, n, gen)
    k, v = _rand((n, H, D), dtype, gen), _rand((n, H, D), dtype, gen)
    _vllm_write(cpu_op, cache, slots, k, v, isa)

    page = cache.view(nb, H, 2 * block_size * D)
    b, o = (slots // block_size)[:, None, None], (slots % block_size)[:, None, None]
    h, d = torch.arange(H)[None, :, None], torch.arange(D)[None, None, :]
    assert torch.equal(page[b, h, d * block_size + o], k)
    assert torch.equal(page[b, h, block_size * D + o * D + d], v)
    assert int((cache != 0).sum()) == int((k != 0).sum() + (v != 0).sum())  # nothing else written


@pytest.mark.parametrize(CPU_ARGS, CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_gather_reads_what_vllm_wrote(cpu_op, block_size, dtype, isa):
    gen = torch.Generator().manual_seed(2)
    nb, n = 6, 2 * block_size + 5
    cache = _rand((nb, H, block_size, 2 * D), dtype, gen)
    slots = _scattered_slots(nb, block_size, n, gen)
    k, v = _rand((n, H, D), dtype, gen), _rand((n, H, D), dtype, gen)
    _vllm_write(cpu_op, cache, slots, k, v, isa)

    layout = layout_for(cache, "CPU_ATTN", block_size, H, D, isa=isa)  # the ISA the cache was written with
    assert isinstance(layout, CpuKVLayout)
    kg, vg = layout.gather(cache, slots)
    assert kg.dtype == dtype and kg.shape == (n, H, D) and kg.is_contiguous() and vg.is_contiguous()
    assert torch.equal(kg, k) and torch.equal(vg, v)
    # Copies, not views.
    kg.zero_()
    assert torch.equal(layout.gather(cache, slots)[0], k)


@pytest.mark.parametrize("use_vllm_op", [True, False], ids=["op", "torch"])
@pytest.mark.parametrize(CPU_ARGS, CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_scatter_writes_what_vllm_writes(cpu_op, block_size, dtype, isa, use_vllm_op):
    gen = torch.Generator().manual_seed(3)
    nb, n = 6, 2 * block_size + 5
    ours = _rand((nb, H, block_size, 2 * D), dtype, gen)
    ref = ours.clone()
    slots = _scattered_slots(nb, block_size, n, gen)
    k, v = _rand((n, H, D), dtype, gen), _rand((n, H, D), dtype, gen)
    _vllm_write(cpu_op, ref, slots, k, v, isa)

    layout = CpuKVLayout(block_size, H, D, isa=isa, use_vllm_op=use_vllm_op)
    layout.scatter(ours, slots, k, v)
    assert torch.equal(ours, ref)  # the whole cache: the rest is untouched
    # Rows of a staging buffer ([tokens, layers, 2, H, D]), a stride apart, write the same.
    staging = _rand((n, 3, 2, H, D), dtype, gen)
    staging[:, 1, 0], staging[:, 1, 1] = k, v
    again = _rand((nb, H, block_size, 2 * D), dtype, gen)
    layout.scatter(again, slots, staging[:, 1, 0], staging[:, 1, 1])
    assert torch.equal(layout.gather(again, slots)[0], k) and torch.equal(layout.gather(again, slots)[1], v)


@pytest.mark.parametrize(CPU_ARGS, CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_request_with_partial_last_block(cpu_op, block_size, dtype, isa):
    """A request's tokens through its (non-monotonic) block table, the last block half full."""
    gen = torch.Generator().manual_seed(4)
    nb = 8
    table = torch.tensor([5, 0, 6])
    positions = torch.arange(2 * block_size + block_size // 2)
    slots = slots_for_positions(table, positions, block_size)
    cache = _rand((nb, H, block_size, 2 * D), dtype, gen)
    k, v = _rand((len(slots), H, D), dtype, gen), _rand((len(slots), H, D), dtype, gen)
    _vllm_write(cpu_op, cache, slots, k, v, isa)

    layout = CpuKVLayout(block_size, H, D, isa=isa)
    kg, vg = layout.gather(cache, slots)
    assert torch.equal(kg, k) and torch.equal(vg, v)
    # A sub-range of positions (e.g. one chunk) straight from the positions.
    part = positions[block_size - 3 : block_size + 7]
    kp, vp = layout.gather(cache, slots_for_positions(table, part, block_size))
    assert torch.equal(kp, k[part]) and torch.equal(vp, v[part])


@pytest.mark.parametrize(CPU_ARGS, CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_blocks(cpu_op, block_size, dtype, isa):
    gen = torch.Generator().manual_seed(5)
    nb = 6
    cache = _rand((nb, H, block_size, 2 * D), dtype, gen)
    layout = layout_for(cache, "CPU_ATTN", block_size, H, D, isa=isa)
    ids = torch.tensor([4, 1, 3])

    kb, vb = layout.gather_blocks(cache, ids)
    ks, vs = layout.gather(cache, layout.block_slots(ids))
    assert kb.shape == (len(ids) * block_size, H, D)
    assert torch.equal(kb, ks) and torch.equal(vb, vs)

    k, v = _rand(kb.shape, dtype, gen), _rand(vb.shape, dtype, gen)
    ref = cache.clone()
    _vllm_write(cpu_op, ref, layout.block_slots(ids), k, v, isa)
    layout.scatter_blocks(cache, ids, k, v)
    assert torch.equal(cache, ref)
    assert all(torch.equal(a, b) for a, b in zip(layout.gather_blocks(cache, ids), (k, v)))


@pytest.mark.parametrize(("block_size", "head_size"), [(32, 64), (128, 64), (64, 128)])
def test_cpu_amx_page_map(block_size, head_size):
    """The map read off vLLM's op matches the VNNI tiling seen in vLLM 0.32 (the reference the
    other AMX cases write with where the op cannot): K in 16-token tiles, d pairs interleaved per
    token; V after all of K, in 16-column tiles, token pairs interleaved."""
    pytest.importorskip("vllm")
    from cpu_probes import amx_page_map_reference, amx_write_unsupported

    from ucm.integration.vllm.kv_layout.cpu import _page_map

    if amx_write_unsupported():
        pytest.skip(amx_write_unsupported())
    k_map, v_map = _page_map("amx", block_size, head_size)
    want_k, want_v = amx_page_map_reference(block_size, head_size)
    assert torch.equal(k_map, want_k) and torch.equal(v_map, want_v)
    t, d = torch.arange(block_size)[:, None], torch.arange(head_size)[None, :]
    # So the vec layout would read garbage from an AMX cache.
    assert not torch.equal(k_map, d * block_size + t)


def test_cpu_unsupported_isas_are_refused(cpu_op):
    with pytest.raises(NotImplementedError, match="neon"):
        CpuKVLayout(128, H, D, isa="neon")
    with pytest.raises(NotImplementedError, match="block_size % 32"):
        CpuKVLayout(16, H, D, isa="amx")


def test_cpu_default_isa_follows_vllm():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    expected = _get_attn_isa(torch.float32, 128, D)
    assert layout_for(torch.zeros(1, H, 128, 2 * D), "CPU_ATTN", 128, H, D).isa == expected
    assert CpuKVLayout(16, H, D, dtype=torch.float32).isa == "vec16"
    # bfloat16 on a host with AMX: vLLM packs the cache in VNNI tiles, and so does the layout.
    bf16 = layout_for(torch.zeros(1, H, 128, 2 * D, dtype=torch.bfloat16), "CPU_ATTN", 128, H, D)
    assert bf16.isa == _get_attn_isa(torch.bfloat16, 128, D)


def test_cpu_rejects_noncontiguous_and_quantized_caches():
    cache = torch.zeros(4, H, 16, 2 * D)
    layout = CpuKVLayout(16, H, D, isa="vec16")
    with pytest.raises(ValueError, match="contiguous"):
        layout.gather(cache[::2], torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="dtype"):
        layout.gather(torch.zeros(4, H, 16, 2 * D, dtype=torch.uint8), torch.tensor([0]))


# ----------------------------------------------------------------------------- FLASH_ATTN


def _vllm_layer_view(layout_name, num_blocks, block_size, dtype, num_layers=2, layer=1):
    """One layer's logical [B, H, N, 2D] cache as vLLM's allocator builds it (any stride order)."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=dtype)
    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    raw = torch.zeros(num_layers * num_blocks * spec.page_size_bytes, dtype=torch.int8)
    shape = (num_layers, num_blocks, H, block_size, spec.state_content_size_bytes)
    views = torch.as_strided(raw, shape, strides)
    return views[layer].view(dtype), raw


def _flash_reference_write(kv_cache, slots, k, v):
    """reshape_and_cache_flash, one token at a time, on FlashAttention's own K/V split."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)  # (B, N, H, D) each
    bs = kv_cache.shape[2]
    for i, s in enumerate(slots.tolist()):
        key_cache[s // bs, s % bs] = k[i]
        value_cache[s // bs, s % bs] = v[i]


KV_LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
FLASH_CASES = [(bs, dt) for bs in (16, 128) for dt in DTYPES]
FLASH_IDS = [f"bs{bs}-{str(dt)[6:]}" for bs, dt in FLASH_CASES]


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize(("block_size", "dtype"), FLASH_CASES, ids=FLASH_IDS)
def test_flash_matches_reference(kv_layout, block_size, dtype):
    gen = torch.Generator().manual_seed(7)
    nb, n = 5, 2 * block_size + 3
    kv_cache, raw = _vllm_layer_view(kv_layout, nb, block_size, dtype)
    raw.copy_(torch.randint(-128, 127, raw.shape, generator=gen, dtype=torch.int8))
    kv_cache.masked_fill_(~torch.isfinite(kv_cache), 0)  # random bytes may be NaN/inf
    slots = _scattered_slots(nb, block_size, n, gen)
    k, v = _rand((n, H, D), dtype, gen), _rand((n, H, D), dtype, gen)

    ref_raw = raw.clone()
    ref_cache = torch.as_strided(ref_raw.view(dtype), kv_cache.shape, kv_cache.stride(),
                                 kv_cache.storage_offset())
    _flash_reference_write(ref_cache, slots, k, v)

    layout = layout_for(kv_cache, "FLASH_ATTN", block_size, H, D)
    assert isinstance(layout, FlashKVLayout)
    layout.scatter(kv_cache, slots, k, v)
    assert torch.equal(raw, ref_raw)  # bytes of every layer: only our slots changed
    kg, vg = layout.gather(kv_cache, slots)
    assert kg.is_contiguous() and vg.is_contiguous()
    assert torch.equal(kg, k) and torch.equal(vg, v)

    ids = torch.tensor([3, 0])
    kb, vb = layout.gather_blocks(kv_cache, ids)
    ks, vs = layout.gather(kv_cache, layout.block_slots(ids))
    assert torch.equal(kb, ks) and torch.equal(vb, vs)
    layout.scatter_blocks(kv_cache, ids, vb, kb)  # swap K and V of those blocks
    _flash_reference_write(ref_cache, layout.block_slots(ids), vb, kb)
    assert torch.equal(raw, ref_raw)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_flash_default_physical_layout(dtype):
    """Default LBNHC: physically [num_blocks, block_size, H, 2D] with K = [..., :D]."""
    gen = torch.Generator().manual_seed(8)
    nb, bs, n = 4, 16, 30
    physical = torch.zeros(nb, bs, H, 2 * D, dtype=dtype)
    kv_cache = physical.permute(0, 2, 1, 3)  # the logical [B, H, N, 2D] view vLLM hands over
    slots = _scattered_slots(nb, bs, n, gen)
    k, v = _rand((n, H, D), dtype, gen), _rand((n, H, D), dtype, gen)
    FlashKVLayout(bs, H, D).scatter(kv_cache, slots, k, v)
    assert torch.equal(physical[slots // bs, slots % bs, :, :D], k)
    assert torch.equal(physical[slots // bs, slots % bs, :, D:], v)


def test_flash_kernel_blocks_smaller_than_manager_blocks():
    """vLLM may split a 64-token manager block into 16-token kernel blocks: the tensor then has
    4x the blocks; slots are unchanged and gather_blocks takes manager block ids."""
    gen = torch.Generator().manual_seed(9)
    manager_bs, kernel_bs, manager_blocks = 64, 16, 3
    kv_cache = _rand((manager_blocks * 4, H, kernel_bs, 2 * D), torch.float32, gen)
    layout = layout_for(kv_cache, "FLASH_ATTN", manager_bs, H, D)
    assert layout.kernel_block_size == kernel_bs and layout.num_blocks(kv_cache) == manager_blocks
    slots = slots_for_positions(torch.tensor([2, 0]), torch.arange(100), manager_bs)
    k, v = _rand((100, H, D), torch.float32, gen), _rand((100, H, D), torch.float32, gen)
    layout.scatter(kv_cache, slots, k, v)
    ref = kv_cache.transpose(1, 2).flatten(0, 1)  # [slots, H, 2D]
    assert torch.equal(ref[slots, :, :D], k) and torch.equal(ref[slots, :, D:], v)
    kb, vb = layout.gather_blocks(kv_cache, torch.tensor([2, 0]))
    assert kb.shape == (2 * manager_bs, H, D)
    assert torch.equal(kb[:100], k) and torch.equal(vb[:100], v)


# ----------------------------------------------------------------------------- common


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_empty_and_dtype_conversion(backend):
    cache = torch.zeros(2, H, 16, 2 * D, dtype=torch.bfloat16)
    layout = layout_for(cache, backend, 16, H, D, **({"isa": "vec16"} if backend == "CPU_ATTN" else {}))
    empty = torch.empty(0, dtype=torch.long)
    k, v = layout.gather(cache, empty)
    assert k.shape == (0, H, D) and v.dtype == torch.bfloat16
    layout.scatter(cache, empty, k, v)
    assert layout.gather_blocks(cache, empty)[0].shape == (0, H, D)
    kf = torch.randn(2, H, D)  # float32 into a bfloat16 cache
    layout.scatter(cache, [3, 20], kf, -kf)
    kg, vg = layout.gather(cache, [3, 20])
    assert torch.equal(kg, kf.to(torch.bfloat16)) and torch.equal(vg, (-kf).to(torch.bfloat16))
    with pytest.raises(ValueError, match="must be"):
        layout.scatter(cache, [3], kf, kf)


def test_layout_for_backend_names():
    cache = torch.zeros(2, H, 32, 2 * D)
    assert SUPPORTED_BACKENDS == ("CPU_ATTN", "FLASH_ATTN")
    assert isinstance(layout_for(cache, "CPU_ATTN", 32, H, D, isa="vec"), CpuKVLayout)
    assert isinstance(layout_for(cache, "FLASH_ATTN", 32, H, D), FlashKVLayout)
    for name in ("TRITON_ATTN", "FLASHINFER", "bogus"):
        with pytest.raises(NotImplementedError, match="supported: CPU_ATTN, FLASH_ATTN"):
            layout_for(cache, name, 32, H, D)
    with pytest.raises(ValueError, match="4-D"):
        layout_for(cache.view(2, H, 32, 2, D), "FLASH_ATTN", 32, H, D)
    with pytest.raises(ValueError, match="expects"):
        layout_for(cache, "FLASH_ATTN", 32, H + 1, D)
    with pytest.raises(ValueError, match="divide"):
        layout_for(cache, "FLASH_ATTN", 48, H, D)
    assert issubclass(CpuKVLayout, KVLayout) and issubclass(FlashKVLayout, KVLayout)


def test_backend_names_are_vllms():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    assert CpuKVLayout.backend_name == CPUAttentionBackend.get_name()
    assert FlashKVLayout.backend_name == FlashAttentionBackend.get_name()


@pytest.mark.parametrize(("backend", "isa", "kbs", "dtype"),
                         [("CPU_ATTN", "vec16", 16, torch.float32), ("CPU_ATTN", "amx", 32, torch.bfloat16),
                          ("FLASH_ATTN", None, 16, torch.float32)], ids=["cpu-vec16", "cpu-amx", "flash"])
def test_gather_pages_head_major(cache_write, backend, isa, kbs, dtype):
    """The attention operands: K transposed [H, D, n] and V [H, n, D] of kernel blocks, in order."""
    gen = torch.Generator().manual_seed(11)
    cache = _rand((5, H, kbs, 2 * D), dtype, gen)
    # Manager blocks of two kernel blocks each: the method takes kernel block ids.
    layout = layout_for(cache, backend, 2 * kbs, H, D, **({"isa": isa} if isa else {}))
    kernel_blocks = torch.tensor([3, 0, 4])
    k, v = layout.gather(cache, (kernel_blocks[:, None] * kbs + torch.arange(kbs)).flatten())
    k_t, vh = layout.gather_pages_head_major(cache, kernel_blocks)
    assert torch.equal(k_t, k.permute(1, 2, 0)) and torch.equal(vh, v.transpose(0, 1))
    k_only, none = layout.gather_pages_head_major(cache, kernel_blocks, values=False)
    assert torch.equal(k_only, k_t) and none is None
    if isa == "vec16":  # the page view the native kernel reads: K^T then V per (page, head)
        pages = layout.pages(cache)
        assert torch.equal(pages[3, :, : kbs * D].view(H, D, kbs), k_t[:, :, :kbs])
        assert torch.equal(pages[3, :, kbs * D:].view(H, kbs, D), vh[:, :kbs])
    if backend == "CPU_ATTN":
        assert layout.page_format == ("amx" if isa == "amx" else "vec")
    k_t, vh = layout.gather_pages_head_major(cache, torch.empty(0, dtype=torch.long))
    assert k_t.shape == (H, D, 0) and vh.shape == (H, 0, D)


@pytest.mark.parametrize(CPU_ARGS, CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_add_pages_adds_to_each_slot_of_the_grid(cpu_op, block_size, dtype, isa):
    """The KV shift's page-wise add: every slot of the touched pages gets its grid row, nothing
    else changes (vec pages in place; AMX tiles as whole pages, bit for bit what a gather, add in
    float32 and scatter of every slot gives, by the tiling and by the inverse page map)."""
    gen = torch.Generator().manual_seed(7)
    nb, n = 6, 2 * block_size + 5
    cache = _rand((nb, H, block_size, 2 * D), dtype, gen)
    layout = CpuKVLayout(block_size, H, D, isa=isa)
    slots = _scattered_slots(nb, block_size, n, gen)
    pages, grid = layout.page_grid(slots)
    assert torch.equal(pages, torch.unique(slots // block_size))
    assert torch.equal(pages[grid // block_size] * block_size + grid % block_size, slots)
    all_slots = torch.arange(nb * block_size)
    k0, v0 = layout.gather(cache, all_slots)
    dk = torch.zeros(pages.numel() * block_size, H, D)
    dv = torch.zeros_like(dk)
    dk[grid], dv[grid] = _rand((n, H, D), torch.float32, gen), _rand((n, H, D), torch.float32, gen)
    layout.add_pages(cache, pages, dk, dv)
    k1, v1 = layout.gather(cache, all_slots)
    want_k, want_v = k0.float().clone(), v0.float().clone()
    want_k[slots] += dk[grid]
    want_v[slots] += dv[grid]
    tol = 0 if dtype == torch.float32 else 0.05
    assert torch.allclose(k1.float(), want_k, atol=tol) and torch.allclose(v1.float(), want_v, atol=tol)
    if layout.page_format == "amx":
        from ucm.integration.vllm.kv_layout.base import KVLayout

        for tiled in (True, False):
            mine, generic = cache.clone(), cache.clone()
            layout._tiled = tiled  # False: the inverse page map's path
            layout.add_pages(mine, pages, dk, dv)
            KVLayout.add_pages(layout, generic, pages, dk, dv)
            assert torch.equal(mine, generic)


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("amx", torch.bfloat16)])
def test_kv_shift_plan_moves_left_out_rows_by_their_chunks_mean_error(cpu_op, isa, dtype):
    """KVShiftPlan over a paged cache: a common pre-RoPE K error and V error per chunk, measured
    on the recomputed rows (still holding their stored KV when the plan runs), is removed from
    the rows left out (by each chunk's share of it); rows of a chunk with nothing recomputed and
    other slots stay as they are."""
    from ucm.integration.vllm.blend.sparse_attention import KVShiftPlan
    from ucm.sparse.blend.rope import rotate_keys

    gen = torch.Generator().manual_seed(8)
    bs, nb, n = 128, 5, 300
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(4096).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    layout = CpuKVLayout(bs, H, D, isa=isa)
    cache = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    pos = torch.arange(100, 100 + n)
    chunk = torch.div(torch.arange(n), 100, rounding_mode="floor")  # 3 chunks of 100 rows
    fresh_pre = torch.randn(n, H, D, generator=gen)
    fresh_v = torch.randn(n, H, D, generator=gen)
    err_k, err_v = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    layout.scatter(cache, slots, rotate_keys(fresh_pre - err_k[chunk], pos, cs, True), fresh_v - err_v[chunk])
    recomputed = (torch.arange(n) % 7 == 0) & (chunk < 2)  # chunk 2: nothing recomputed
    left = ~recomputed
    plan = KVShiftPlan.build(layout, torch.arange(int(recomputed.sum())), slots[recomputed], chunk[recomputed],
                             pos[recomputed], slots[left], chunk[left], pos[left], torch.tensor([1.0, 0.5, 1.0]), cs,
                             True)
    before = layout.gather(cache, slots)
    plan.apply(layout, cache, rotate_keys(fresh_pre[recomputed], pos[recomputed], cs, True).to(dtype),
               fresh_v[recomputed].to(dtype))
    k, v = layout.gather(cache, slots)
    moved = left & (chunk < 2)
    whole, half = left & (chunk == 0), left & (chunk == 1)  # chunk 1 is moved by half its mean error
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(k[whole].float(), rotate_keys(fresh_pre, pos, cs, True)[whole], atol=tol)
    assert torch.allclose(v[whole].float(), fresh_v[whole], atol=tol)
    assert torch.allclose(k[half].float(), rotate_keys(fresh_pre - err_k[chunk] / 2, pos, cs, True)[half], atol=tol)
    assert torch.allclose(v[half].float(), (fresh_v - err_v[chunk] / 2)[half], atol=tol)
    assert torch.equal(k[~moved], before[0][~moved]) and torch.equal(v[~moved], before[1][~moved])
    assert int((cache != 0).sum()) <= 2 * n * H * D  # nothing written outside the rows


@pytest.mark.parametrize(("backend", "isa", "kbs", "dtype"),
                         [("CPU_ATTN", "vec", 16, torch.float32), ("CPU_ATTN", "vec16", 16, torch.bfloat16),
                          ("CPU_ATTN", "amx", 32, torch.bfloat16), ("FLASH_ATTN", None, 16, torch.float32)],
                         ids=["cpu-vec", "cpu-vec16", "cpu-amx", "flash"])
def test_gather_layers_into_matches_gather(backend, isa, kbs, dtype):
    """A dump's block tensor [n, layers, 2, H, D]: equal to per-layer `gather` for whole pages, slots
    that start mid-page, cross pages and manager blocks, jump back, and for a lone slot (on CPU
    pages through the native copy where it is built: checked to have run)."""
    gen = torch.Generator().manual_seed(12)
    caches = [_rand((6, H, kbs, 2 * D), dtype, gen) for _ in range(3)]
    layout = layout_for(caches[0], backend, 2 * kbs, H, D, **({"isa": isa} if isa else {}))
    table = torch.tensor([2, 0])  # manager blocks of two kernel blocks: kernel blocks 4, 5, 0, 1
    cases = [
        slots_for_positions(table, torch.arange(3, 3 + 2 * kbs + 5), 2 * kbs),
        torch.tensor([7, 8, 9, 3 * kbs + 1, 3 * kbs + 2, 0]),
        torch.tensor([kbs - 1]),
        torch.arange(kbs, 3 * kbs),
        torch.empty(0, dtype=torch.long),
    ]
    if backend == "CPU_ATTN" and NATIVE_ISAS:  # the native module is built
        from ucm.integration.vllm.kv_layout.base import _page_runs

        out = torch.empty(2 * kbs, len(caches), 2, H, D, dtype=dtype)
        assert gather_page_runs(caches, _page_runs(cases[-2], kbs), out, kbs, layout.page_format)
        stored = torch.empty(len(caches), 2 * kbs, 2, H, D, dtype=dtype).transpose(0, 1)  # layer-major
        assert gather_page_runs(caches, _page_runs(cases[-2], kbs), stored, kbs, layout.page_format)
        assert torch.equal(stored, out)
    for slots in cases:
        for out in (torch.full((len(slots), len(caches), 2, H, D), float("nan"), dtype=dtype),
                    torch.full((len(caches), len(slots), 2, H, D), float("nan"), dtype=dtype).transpose(0, 1)):
            layout.gather_layers_into(caches, slots, out)
            for layer, cache in enumerate(caches):
                k, v = layout.gather(cache, slots)
                assert torch.equal(out[:, layer, 0], k) and torch.equal(out[:, layer, 1], v)
