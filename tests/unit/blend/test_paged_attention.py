"""The native paged attention kernel against a dense causal reference and the torch path."""

import math
import os
import subprocess
import sys

import pytest
import torch

from ucm.sparse.blend.query_probe import attention_mass
from ucm.sparse.blend.runs import causal_attention_reference
from ucm.sparse.blend.tiled_attention import (NATIVE_ISAS, TilePlan, native_mass_supported, native_supported,
                                               paged_attention_mass, paged_causal_attention, tiled_causal_attention)

pytestmark = pytest.mark.skipif(not native_supported(torch.float32, 64, 32),
                                reason="native paged attention needs the built extension and AVX-512F or AVX2")
# Each test runs every variant of the kernel this CPU can run (AVX-512F hosts: both).
isas = pytest.mark.parametrize("isa", NATIVE_ISAS or [None])


def paged(k, v, page_size, spare=3, seed=0):
    """K/V of one sequence ([S, Hk, D]) in shuffled pages among unused ones; returns (pages, table)."""
    s, hk, d = k.shape
    n = (s + page_size - 1) // page_size
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(n + spare, hk, 2 * page_size * d, generator=g)
    table = torch.randperm(n + spare, generator=g)[:n]
    kp = torch.zeros(n * page_size, hk, d)
    vp = torch.zeros(n * page_size, hk, d)
    kp[:s], vp[:s] = k, v
    view = pages.view(n + spare, hk, 2, page_size * d)
    view[table, :, 0] = kp.view(n, page_size, hk, d).permute(0, 2, 3, 1).reshape(n, hk, -1)  # K^T [D, P]
    view[table, :, 1] = vp.view(n, page_size, hk, d).transpose(1, 2).reshape(n, hk, -1)  # V [P, D]
    return pages, table


@isas
@pytest.mark.parametrize("kv_heads,group,d,page_size,tile", [
    (3, 3, 64, 128, 32), (3, 3, 64, 32, 5), (2, 4, 128, 64, 32), (1, 1, 64, 32, 1), (4, 2, 128, 128, 7)])
def test_matches_dense_causal_reference(kv_heads, group, d, page_size, tile, isa):
    gen = torch.Generator().manual_seed(kv_heads * 100 + d + tile)
    num_keys = 5 * page_size + 3
    # Singles, runs, page boundaries, the first and the last key.
    q_pos = torch.tensor(sorted({0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size + 7,
                                 *range(3 * page_size - 4, 3 * page_size + 20), num_keys - 2, num_keys - 1}))
    q = torch.randn(q_pos.shape[0], kv_heads * group, d, generator=gen) * 3
    k = torch.randn(num_keys, kv_heads, d, generator=gen)
    v = torch.randn(num_keys, kv_heads, d, generator=gen)
    pages, table = paged(k, v, page_size)
    scale = 1 / math.sqrt(d)
    got = paged_causal_attention(q, q_pos, pages, table, scale, tile=tile, isa=isa)
    want = causal_attention_reference(q, k, v, q_pos, torch.arange(num_keys), scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    plan = TilePlan.build(q_pos, group)
    torch_path = tiled_causal_attention(q, k.permute(1, 2, 0).contiguous(), v.transpose(0, 1).contiguous(), plan,
                                        scale)
    torch.testing.assert_close(got, torch_path, rtol=2e-5, atol=2e-5)


def vllm_pages(op, k, v, page_size, isa, spare=3, seed=0, fill=None):
    """K/V of one sequence ([S, Hk, D], bfloat16 or float32) written by vLLM's cache-write ``op``
    for ``isa`` into shuffled pages among unused ones, whose slots hold random values or `fill`;
    returns (pages, table)."""
    s, hk, d = k.shape
    n = (s + page_size - 1) // page_size
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(n + spare, hk, page_size, 2 * d, generator=g).to(k.dtype)
    if fill is not None:
        cache.fill_(fill)
    table = torch.randperm(n + spare, generator=g)[:n]
    key_cache, value_cache = cache.view(n + spare, hk, 2 * page_size, d).chunk(2, dim=2)
    slots = table[torch.arange(s) // page_size] * page_size + torch.arange(s) % page_size
    op(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, isa)
    return cache.view(n + spare, hk, -1), table


@pytest.mark.parametrize("dtype,isa,page_format", [(torch.float32, "vec", "vec"), (torch.bfloat16, "vec", "vec"),
                                                   (torch.bfloat16, "amx", "amx")], ids=["f32", "bf16", "bf16-amx"])
@pytest.mark.parametrize("kv_heads,group,d,page_size", [(3, 3, 64, 32), (2, 2, 128, 64)])
@pytest.mark.parametrize("kernel", NATIVE_ISAS or [None])
def test_pages_as_vllm_writes_them(cache_write, dtype, isa, page_format, kv_heads, group, d, page_size, kernel):
    """Pages written by vLLM's op in each format the kernel reads: float32 or bfloat16 in the vec
    layout, and bfloat16 in AMX's VNNI tiles (written by the reference tiling where this CPU's
    vLLM build cannot pack them; see tests/cpu_probes.py). The reference computes in float32 on
    the same (rounded) K/V, so only summation order differs; the dot variant on bfloat16 pages
    and the AMX one on AMX pages also round the queries and the softmax weights to bfloat16 (the
    reference the queries)."""
    gen = torch.Generator().manual_seed(d + page_size)
    num_keys = 5 * page_size + 3  # a last page with an odd number of keys (AMX pairs them)
    q_pos = torch.tensor(sorted({0, 1, 2, page_size - 1, page_size, 2 * page_size + 7,
                                 *range(3 * page_size - 4, 3 * page_size + 9), num_keys - 2, num_keys - 1}))
    q = torch.randn(q_pos.shape[0], kv_heads * group, d, generator=gen) * 3
    k = torch.randn(num_keys, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(num_keys, kv_heads, d, generator=gen).to(dtype)
    pages, table = vllm_pages(cache_write, k, v, page_size, isa)
    scale = 1 / math.sqrt(d)
    assert native_supported(dtype, d, page_size, page_format=page_format)
    got = paged_causal_attention(q, q_pos, pages, table, scale, page_format=page_format, isa=kernel)
    dot = rounds_to_bf16(kernel, dtype, page_format)
    want = causal_attention_reference(q.bfloat16().float() if dot else q, k.float(), v.float(), q_pos,
                                      torch.arange(num_keys), scale)
    # Weights rounded to bfloat16 (relative error 2**-9 each) move these outputs by up to ~2.5e-3.
    torch.testing.assert_close(got, want, rtol=1e-2 if dot else 2e-5, atol=1e-2 if dot else 2e-5)
    # Queries in the model's dtype come back in it.
    got16 = paged_causal_attention(q.to(dtype), q_pos, pages, table, scale, page_format=page_format, isa=kernel)
    assert got16.dtype == dtype
    want16 = causal_attention_reference(q.to(dtype).float(), k.float(), v.float(), q_pos, torch.arange(num_keys), scale)
    torch.testing.assert_close(got16, want16.to(dtype), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif("amx" not in NATIVE_ISAS, reason="the AMX variant needs a CPU with AMX (and the kernel's "
                    "permission to use its tiles)")
@pytest.mark.parametrize("kv_heads,group,d,page_size,tile", [
    (3, 3, 64, 128, 32), (2, 6, 128, 128, 32), (2, 7, 64, 64, 5), (1, 1, 128, 32, 1)])
def test_amx_variant_on_pages_vllm_packed(cache_write, kv_heads, group, d, page_size, tile):
    """The AMX variant over AMX pages of every page size vLLM uses, with rows in several 16-row
    blocks, tiles that start mid-page, a last page ending inside a 32-key pair block and NaN in
    every unwritten slot: as the dense reference on the same rounded queries, K and V."""
    gen = torch.Generator().manual_seed(d + page_size + group)
    num_keys = 7 * page_size + 21
    q_pos = torch.tensor(sorted({0, 5, page_size - 1, page_size, *range(2 * page_size + 3, 2 * page_size + 40),
                                 *torch.randint(0, num_keys, (60,), generator=gen).tolist(), num_keys - 1}))
    q = (torch.randn(q_pos.shape[0], kv_heads * group, d, generator=gen) * 3).bfloat16()
    k = torch.randn(num_keys, kv_heads, d, generator=gen).bfloat16()
    v = torch.randn(num_keys, kv_heads, d, generator=gen).bfloat16()
    pages, table = vllm_pages(cache_write, k, v, page_size, "amx", fill=float("nan"))
    got = paged_causal_attention(q, q_pos, pages, table, d ** -0.5, tile=tile, page_format="amx", isa="amx")
    want = causal_attention_reference(q.float(), k.float(), v.float(), q_pos, torch.arange(num_keys), d ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # The same products as the dot variant, in another order: float32 sums of bfloat16 products.
    dot = paged_causal_attention(q, q_pos, pages, table, d ** -0.5, tile=tile, page_format="amx", isa="avx512_bf16")
    torch.testing.assert_close(got.float(), dot.float(), rtol=1e-2, atol=1e-2)


def rounds_to_bf16(kernel, dtype, page_format) -> bool:
    """Whether this variant on these pages computes with bfloat16 queries and softmax weights (the
    AMX variant takes AMX pages only; it runs the others widened)."""
    kernel = kernel or (NATIVE_ISAS or [None])[0]
    return dtype == torch.bfloat16 and (kernel == "avx512_bf16" or (kernel == "amx" and page_format == "amx"))


@pytest.mark.parametrize("page_format,isa", [("vec", "vec"), ("amx", "amx")])
@pytest.mark.parametrize("d,page_size", [(64, 32), (128, 64)])
@pytest.mark.parametrize("kernel", NATIVE_ISAS or [None])
def test_bf16_slots_past_the_last_key_may_hold_nan(cache_write, page_format, isa, d, page_size, kernel):
    """An odd number of keys: the dot variant reads keys in pairs and whole 32-key blocks, so the
    last pair's second slot and the rest of the page (unwritten cache: NaN here) are read and
    must not reach the output."""
    gen = torch.Generator().manual_seed(d)
    num_keys = 3 * page_size + 5
    q_pos = torch.tensor([0, 1, page_size, 2 * page_size + 3, num_keys - 2, num_keys - 1])
    q = torch.randn(6, 4, d, generator=gen).bfloat16()
    k = torch.randn(num_keys, 2, d, generator=gen).bfloat16()
    v = torch.randn(num_keys, 2, d, generator=gen).bfloat16()
    clean, table = vllm_pages(cache_write, k, v, page_size, isa)
    dirty, table2 = vllm_pages(cache_write, k, v, page_size, isa, fill=float("nan"))
    assert torch.equal(table, table2)
    got = paged_causal_attention(q, q_pos, dirty, table, d ** -0.5, page_format=page_format, isa=kernel)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_causal_attention(q, q_pos, clean, table, d ** -0.5,
                                                           page_format=page_format, isa=kernel), rtol=0, atol=0)


@isas
def test_keys_after_each_query_are_never_read(isa):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(200, 2, 64, generator=gen), torch.randn(200, 2, 64, generator=gen)
    q_pos = torch.tensor([3, 4, 70, 150])
    q = torch.randn(4, 6, 64, generator=gen)
    pages, table = paged(k, v, 32)
    before = paged_causal_attention(q, q_pos, pages, table, 0.125, isa=isa)
    later = k.clone(), v.clone()
    later[0][71:], later[1][71:] = 1e4, -1e4  # keys after the third query
    pages2, table2 = paged(*later, 32)
    after = paged_causal_attention(q, q_pos, pages2, table2, 0.125, isa=isa)
    torch.testing.assert_close(after[:3], before[:3])
    assert not torch.allclose(after[3], before[3])
    # Slots past the last query (unwritten cache) may hold anything, NaN included.
    halves = pages.view(pages.shape[0], 2, 2, 32 * 64)
    kt, vv = halves[:, :, 0].view(-1, 2, 64, 32), halves[:, :, 1].view(-1, 2, 32, 64)
    page, slot = table[150 // 32], 150 % 32 + 1
    kt[page, :, :, slot:] = float("nan")
    vv[page, :, slot:] = float("nan")
    halves[table[-2:]] = float("nan")
    torch.testing.assert_close(paged_causal_attention(q, q_pos, pages, table, 0.125, isa=isa), before)


@isas
@pytest.mark.parametrize("seed", range(4))
def test_large_scores_stay_finite(seed, isa):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(300, 1, 64, generator=gen)
    q = torch.randn(2, 1, 64, generator=gen) * 200  # scores in the thousands: online softmax must rescale
    q_pos = torch.tensor([150, 299])
    v = torch.randn(300, 1, 64, generator=gen)
    pages, table = paged(k, v, 32)
    got = paged_causal_attention(q, q_pos, pages, table, 1.0, isa=isa)
    want = causal_attention_reference(q, k, v, q_pos, torch.arange(300), 1.0)
    assert torch.isfinite(got).all()
    # float32 scores of ~4,000 carry rounding of ~4e-4 (summation order differs from the
    # reference), which the near one-hot softmax passes on to the output: over 200 seeds the
    # largest difference was 3.2e-4 (1e-4 failed unseeded in CI-like runs); an overflow or a
    # missed rescale is off by O(1).
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fn", [paged_causal_attention, paged_attention_mass], ids=["attention", "mass"])
def test_rejects_bad_input(fn):
    if fn is paged_attention_mass and not native_mass_supported(torch.float32, 64, 32):
        pytest.skip("the native attention mass needs the built extension and AVX-512F")
    k = v = torch.randn(64, 1, 64)
    pages, table = paged(k, v, 32)
    q = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="sorted"):
        fn(q, torch.tensor([5, 3]), pages, table, 1.0)
    with pytest.raises(ValueError, match="needs 3"):
        fn(q, torch.tensor([5, 70]), pages, table, 1.0)
    with pytest.raises(ValueError, match="outside"):
        fn(q, torch.tensor([5, 6]), pages, torch.tensor([99, 0]), 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        fn(torch.randn(2, 1, 48), torch.tensor([5, 6]), pages, table, 1.0)
    with pytest.raises(RuntimeError, match="unavailable"):
        fn(q, torch.tensor([5, 6]), pages.half(), table, 1.0)
    with pytest.raises(RuntimeError, match="unavailable"):  # AMX tiles exist for bfloat16 only
        fn(q, torch.tensor([5, 6]), pages, table, 1.0, page_format="amx")
    assert fn(q[:0], torch.tensor([], dtype=torch.long), pages, table, 1.0).shape[0] == 0


def test_rejects_unknown_variants_and_geometries():
    k = v = torch.randn(64, 1, 64)
    pages, table = paged(k, v, 32)
    with pytest.raises(ValueError, match="isa must be one of"):
        paged_causal_attention(torch.randn(2, 1, 64), torch.tensor([5, 6]), pages, table, 1.0, isa="sse2")
    assert not native_supported(torch.float16, 64, 32) and not native_supported(torch.float32, 80, 32)
    assert not native_supported(torch.float32, 64, 48) and not native_supported(torch.float32, 64, 32, page_format="amx")


HELPER_CPUS_SCRIPT = """
import os, threading
import ucm.sparse.blend.tiled_attention as ta
print(ta._helper_cpus())
ready, done = threading.Event(), threading.Event()
def bound_elsewhere():  # like vLLM's OpenMP thread bound to the second core
    os.sched_setaffinity(0, {1}); ready.set(); done.wait()
t = threading.Thread(target=bound_elsewhere); t.start(); ready.wait()
os.sched_setaffinity(0, {0})  # like vLLM's bound main thread
print(ta._helper_cpus())
done.set(); t.join()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_helper_threads_go_to_the_cores_of_the_other_threads():
    """A bound caller's helpers would inherit its one core; they are pinned to the process's other cores."""
    out = subprocess.run([sys.executable, "-c", HELPER_CPUS_SCRIPT], capture_output=True, text=True, check=True)
    unbound, bound = out.stdout.split("\n")[:2]
    assert unbound == "[]" and bound == "[1]"


mass_native = pytest.mark.skipif(not native_mass_supported(torch.float32, 64, 32),
                                 reason="the native attention mass needs the built extension and AVX-512F")


@mass_native
@pytest.mark.parametrize("dtype,isa,page_format", [(torch.float32, "vec", "vec"), (torch.bfloat16, "vec", "vec"),
                                                   (torch.bfloat16, "amx", "amx")], ids=["f32", "bf16", "bf16-amx"])
@pytest.mark.parametrize("kv_heads,group,d,page_size", [(3, 3, 64, 32), (2, 6, 128, 64), (2, 7, 64, 128)])
@pytest.mark.parametrize("weigh", [False, True])
def test_attention_mass_from_pages_matches_the_probe(cache_write, dtype, isa, page_format, kv_heads, group, d,
                                                     page_size, weigh):
    """The probe's attention mass read from vLLM's pages in place equals query_probe.attention_mass
    over the same K/V, with unwritten slots (NaN) past the last key and queries at scattered
    positions (each sees only its keys)."""
    gen = torch.Generator().manual_seed(d + page_size + kv_heads)
    num_keys = 9 * page_size + 5
    q_pos = torch.tensor(sorted({3, page_size + 1, *range(num_keys - 20, num_keys)}))
    q = torch.randn(q_pos.shape[0], kv_heads * group, d, generator=gen).to(dtype) * 2
    k = torch.randn(num_keys, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(num_keys, kv_heads, d, generator=gen).to(dtype)
    pages, table = vllm_pages(cache_write, k, v, page_size, isa, fill=float("nan"))
    got = paged_attention_mass(q, q_pos, pages, table, d ** -0.5, page_format=page_format, weigh_by_values=weigh)
    want = attention_mass(q, k, q_pos, d ** -0.5, v=v if weigh else None)
    assert got.shape == (num_keys,) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # A query sees no key after it: the last keys get mass from the queries at or after them only.
    late = paged_attention_mass(q[-1:], q_pos[-1:], pages, table, d ** -0.5, page_format=page_format)
    torch.testing.assert_close(late.sum(), torch.tensor(float(kv_heads * group)), rtol=1e-5, atol=1e-5)
