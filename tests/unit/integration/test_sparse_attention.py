"""Subset attention (Blend's recomputed rows) on vLLM's real CPU kernel and our tiled path.

A paged cache holds two requests; the subset has scattered rows, long runs and a decode-like
single row. Whatever mix of vLLM's kernel and tiling handles it, every row must equal dense
causal attention over its own request's keys.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ucm.integration.vllm.kv_layout import layout_for
from ucm.sparse.blend.runs import causal_attention_reference, pseudo_request_metadata

HQ, HK, D, BS = 9, 3, 64, 32
LENS = (300, 150)  # keys of request 0 and 1


@pytest.fixture
def vllm_cpu(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends import cpu_attn

    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        pytest.skip("this vLLM build has no CPU attention kernel")
    # The impl reads only the model dtype from the global config (float32 unless a test sets it).
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
    cpu_attn.test_config = config
    return cpu_attn


def build(cpu_attn, selected, dtype=torch.float32, isa=None):
    """Cache, layer, metadata and the dense expectation for `selected` rows of the two requests.
    `isa` None: the one vLLM picks on this CPU for `dtype`."""
    gen = torch.Generator().manual_seed(3)
    cpu_attn.test_config.model_config.dtype = dtype
    isa = isa or cpu_attn._get_attn_isa(dtype, BS, D)
    blocks = [(n + BS - 1) // BS for n in LENS]
    cache = torch.zeros(sum(blocks) + 1, HK, BS, 2 * D, dtype=dtype)
    layout = layout_for(cache, "CPU_ATTN", BS, HK, D, isa=isa)
    table = torch.zeros(2, max(blocks), dtype=torch.int32)
    table[0, : blocks[0]] = torch.arange(1, blocks[0] + 1)  # block 0 unused: ids must matter
    table[1, : blocks[1]] = torch.arange(blocks[0] + 1, blocks[0] + 1 + blocks[1])
    keys = []
    for req, n in enumerate(LENS):
        k, v = torch.randn(n, HK, D, generator=gen).to(dtype), torch.randn(n, HK, D, generator=gen).to(dtype)
        pos = torch.arange(n)
        layout.scatter(cache, table[req].long()[pos // BS] * BS + pos % BS, k, v)
        keys.append((k, v))

    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(LENS)])
    positions = torch.cat([torch.arange(n) for n in LENS])
    mask = torch.zeros(len(positions), dtype=torch.bool)
    for req, pos in selected.items():
        mask[torch.tensor(pos) + sum(LENS[:req])] = True
    pseudo = pseudo_request_metadata(mask, segment, positions)

    impl = cpu_attn.CPUAttentionBackendImpl(HQ, D, 1 / math.sqrt(D), HK, None, None, "auto")
    layer = SimpleNamespace(impl=impl, num_heads=HQ, num_kv_heads=HK, head_size=D, isa=isa,
                            kv_cache_dtype="auto", _k_scale_float=1.0, _v_scale_float=1.0)
    meta = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=len(positions), max_query_len=max(LENS),
        query_start_loc=torch.tensor([0, LENS[0], sum(LENS)], dtype=torch.int32),
        max_seq_len=max(LENS), seq_lens=torch.tensor(LENS, dtype=torch.int32), block_table=table,
        slot_mapping=torch.zeros(len(positions), dtype=torch.int64), scheduler_metadata=None)

    rows = pseudo.token_indices
    q = torch.randn(len(rows), HQ, D, generator=gen).to(dtype)
    want = torch.cat([
        causal_attention_reference(q[segment[rows] == req].float(), keys[req][0].float(), keys[req][1].float(),
                                   positions[rows][segment[rows] == req], torch.arange(LENS[req]), 1 / math.sqrt(D))
        for req in range(2)
    ])
    return cache, layout, layer, meta, pseudo, positions[rows], q, want


SCATTERED = {
    0: [0, 3, 4, 40, 41, 42, 77, 128, 129, 200, *range(230, 260), 299],  # singles, pairs, a 30-run
    1: [149],  # a decode step of another request
}


# (dtype, ISA, tolerance): bfloat16 rows are rounded once more than the float32 reference. AMX
# pages are written by vLLM's op, or by the reference tiling where this CPU's build cannot
# (tests/cpu_probes.py); only vLLM's AMX attention kernel needs AMX itself.
DTYPES = {"f32": (torch.float32, None, 1e-4), "bf16": (torch.bfloat16, "vec", 2e-2),
          "bf16-amx": (torch.bfloat16, "amx", 2e-2)}


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("min_kernel_run", [0, 4, 16, 1000, None], ids=["kernel", "k4", "k16", "k1000", "tiled"])
def test_subset_attention_is_exactly_causal(vllm_cpu, cache_write, monkeypatch, min_kernel_run, native, kind):
    import ucm.integration.vllm.blend.sparse_attention as sa

    dtype, isa, tol = DTYPES[kind]
    if isa == "amx" and min_kernel_run is not None and min_kernel_run < 1000 \
            and not torch.cpu._is_amx_tile_supported():
        # The check vLLM itself makes before it picks ISA "amx" (cpu_attn._get_attn_isa).
        pytest.skip("vLLM's AMX attention kernel: torch reports no AMX tile support on this CPU")
    if native and not sa.native_supported(dtype, D, BS, page_format=isa or "vec"):
        pytest.skip("native paged attention needs the built extension and AVX-512F or AVX2")
    if not native:
        monkeypatch.setattr(sa, "native_supported", lambda *args: False)
    monkeypatch.setattr(sa, "MIN_KERNEL_RUN", min_kernel_run)
    monkeypatch.setattr(sa, "MIN_KERNEL_RUN_NATIVE", min_kernel_run)
    cache, layout, layer, meta, pseudo, pos, q, want = build(vllm_cpu, SCATTERED, dtype, isa)
    sub = sa.subset_metadata(meta, pseudo, torch.zeros(pseudo.num_tokens, dtype=torch.int64), layer,
                             dtype, pos, layout)
    tiled_rows = sum(g.rows.numel() for g in sub.tiled)
    assert tiled_rows + sub.kernel_rows.numel() == pseudo.num_tokens
    assert (tiled_rows == 0) == (min_kernel_run == 0)
    assert all((g.plan is None) == native for g in sub.tiled)
    output = torch.full((pseudo.num_tokens, HQ * D), float("nan"), dtype=dtype)
    impl = sa.SubsetAttentionImpl(layer.impl, layout)
    impl.forward(layer, q, q[:, :HK], q[:, :HK], cache, sub, output=output)
    torch.testing.assert_close(output.view(-1, HQ, D).float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_by_default_runs_go_to_vllm_only_beside_the_torch_tiles(vllm_cpu, monkeypatch, native):
    """The native kernel's AVX-512 variants take every row, the question's and the misses' runs too;
    its AVX2 variant and the torch tiles leave runs of MIN_KERNEL_RUN or more (here the 30-run) to
    vLLM's kernel."""
    import ucm.integration.vllm.blend.sparse_attention as sa

    if native and not sa.native_supported(torch.float32, D, BS):
        pytest.skip("native paged attention needs the built extension and AVX-512F or AVX2")
    if not native:
        monkeypatch.setattr(sa, "native_supported", lambda *args: False)
    cache, layout, layer, meta, pseudo, pos, q, want = build(vllm_cpu, SCATTERED)
    sub = sa.subset_metadata(meta, pseudo, torch.zeros(pseudo.num_tokens, dtype=torch.int64), layer,
                             torch.float32, pos, layout)
    assert sub.kernel_rows.numel() == (0 if native and sa.NATIVE_ISAS[0] in sa.RUNS_NATIVE_ISAS else 30)


def test_impl_delegates_other_metadata_and_is_removed_after_the_pass(vllm_cpu):
    import ucm.integration.vllm.blend.sparse_attention as sa

    cache, layout, layer, meta, pseudo, pos, q, want = build(vllm_cpu, SCATTERED)
    calls = []
    inner = SimpleNamespace(forward=lambda *a, **k: calls.append(a[5]), scale=1.0, head_size=D, other=7)
    impl = sa.SubsetAttentionImpl(inner, layout)
    impl.forward(layer, q, q, q, cache, meta, output=None)
    assert calls == [meta] and impl.other == 7
    layers = [SimpleNamespace(impl=inner)]
    with pytest.raises(RuntimeError):
        with sa.subset_attention(layers, layout):
            assert isinstance(layers[0].impl, sa.SubsetAttentionImpl)
            raise RuntimeError
    assert layers[0].impl is inner
