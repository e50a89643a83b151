"""Attention for a subset of a step's tokens (Blend's recomputed rows), on vLLM's CPU backend.

Selected tokens sit at scattered positions and must attend exactly causally to their request's
whole paged KV. Where the CPU runs the native kernel's AMX or AVX-512 variants (tiled_attention.py: float32
or bfloat16 pages, AMX tiles included) it takes every row of a request, its runs too: per row it is
faster than vLLM's CPU kernel on the question's and the misses' runs as well (docs/research.md).
Otherwise (the AVX2 variant, not measured against vLLM's kernel on long runs, or the torch tiles
over a gathered copy of the pages) runs of at least `MIN_KERNEL_RUN` consecutive positions go to
vLLM's own kernel, each as a pseudo-request (the kernel's bottom-right causal alignment makes that
exact); that kernel would re-read all K/V for every run of one or two tokens.

`subset_attention` installs `SubsetAttentionImpl` in front of each layer's vLLM impl for the
duration of a subset pass; it handles `SubsetAttentionMetadata` and delegates everything else
(the KV-cache write included) to vLLM's impl.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ucm.integration.vllm.blend.rank_faults import RankFaults
from ucm.integration.vllm.faults import inject
from ucm.sparse.blend.kv_shift import chunk_mean_errors, kv_shifts
from ucm.sparse.blend.rope import Rotation
from ucm.sparse.blend.runs import PseudoBatch
from ucm.sparse.blend.tiled_attention import (NATIVE_ISAS, TilePlan, native_supported, paged_causal_attention,
                                               tiled_causal_attention)

# Runs this long or longer go to vLLM's kernel, whose cost per query falls with the run length;
# shorter runs are tiled. Set to 0 to send every run to the kernel. `MIN_KERNEL_RUN_NATIVE` is the
# same where the native kernel's AVX-512 variants tile (None: they take every run).
MIN_KERNEL_RUN = 16
MIN_KERNEL_RUN_NATIVE: int | None = None
# The native kernel's best variants that take every run (`MIN_KERNEL_RUN_NATIVE`): the AVX-512 ones,
# and AMX (on AMX hosts pages not in AMX tiles run the AVX-512 variant).
RUNS_NATIVE_ISAS = ("amx", "avx512_bf16", "avx512")


@dataclass
class TiledGroup:
    """One request's short-run rows: tiled attention over its pages."""

    rows: torch.Tensor  # subset rows, position order
    positions: torch.Tensor  # theirs
    kernel_blocks: torch.Tensor  # block-table entries covering keys 0 .. last position
    plan: TilePlan | None  # for the torch path; None when the native kernel runs


@dataclass
class SubsetAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # the KV of every subset row is written as usual
    kernel: object | None  # vLLM metadata for the long runs, or None
    kernel_rows: torch.Tensor  # subset rows the kernel computes, in its query order
    tiled: list[TiledGroup]


def subset_metadata(meta, pseudo: PseudoBatch, slot_mapping: torch.Tensor, attn_layer, dtype: torch.dtype,
                    positions: torch.Tensor, layout):
    """Metadata for `pseudo`'s tokens; `positions` are theirs, `slot_mapping` their slots; `layout`
    is the layers' CpuKVLayout."""
    name = type(meta).__name__
    if name != "CPUAttentionMetadata":
        raise NotImplementedError(
            f"Blend's sparse forward supports vLLM's CPU attention backend so far; this engine uses {name}. "
            "Run without ucm_sparse_config.Blend (prefix offload still works) or on the CPU build."
        )
    run_len = (pseudo.query_start_loc[1:] - pseudo.query_start_loc[:-1]).long()
    native = native_supported(dtype, attn_layer.head_size, layout.kernel_block_size, slot_mapping.device,
                              layout.page_format)
    threshold = MIN_KERNEL_RUN_NATIVE if native and NATIVE_ISAS[0] in RUNS_NATIVE_ISAS else MIN_KERNEL_RUN
    long_run = run_len >= threshold if threshold is not None else torch.zeros_like(run_len, dtype=torch.bool)
    if not _can_tile(attn_layer.impl, threshold) or bool(long_run.all()):
        rows = torch.arange(pseudo.num_tokens, device=slot_mapping.device)
        return SubsetAttentionMetadata(pseudo.num_tokens, slot_mapping,
                                       _cpu_kernel_metadata(meta, pseudo, attn_layer, dtype), rows, [])
    row_long = torch.repeat_interleave(long_run, run_len)
    kernel, kernel_rows = None, row_long.nonzero().flatten()
    if kernel_rows.numel():
        kernel = _cpu_kernel_metadata(meta, _runs(pseudo, long_run, run_len), attn_layer, dtype)
    row_request = torch.repeat_interleave(pseudo.run_request, run_len)
    group = attn_layer.num_heads // attn_layer.num_kv_heads
    kernel_block_size = layout.kernel_block_size
    tiled = []
    for req in torch.unique(row_request[~row_long]).tolist():
        rows = ((row_request == req) & ~row_long).nonzero().flatten()
        pos = positions[rows].long().contiguous()
        num_blocks = (int(pos[-1]) + kernel_block_size) // kernel_block_size
        tiled.append(TiledGroup(rows, pos, meta.block_table[req, :num_blocks].long().contiguous(),
                                None if native else TilePlan.build(pos, group)))
    return SubsetAttentionMetadata(pseudo.num_tokens, slot_mapping, kernel, kernel_rows, tiled)


@dataclass
class KVShiftPlan:
    """The chunk-mean KV shift of one subset pass (sparse/blend/kv_shift.py): before each layer
    writes the pass's KV, the stored KV of the loaded rows left out is moved by its chunk's mean
    error on the loaded rows the pass recomputes. Built once per forward, applied per layer."""

    src: torch.Tensor  # pass rows (index into its K/V) that are loaded rows
    src_slots: torch.Tensor
    src_chunk: torch.Tensor  # [len(src)] chunk index, in [0, num_chunks)
    src_unrotate: Rotation  # back from their positions
    pages: torch.Tensor  # kernel blocks holding the left-out rows
    grid_chunk: torch.Tensor  # [pages x block] chunk of each page slot; num_chunks where nothing moves
    grid_rotate: Rotation  # to each page slot's position
    share: torch.Tensor  # [num_chunks] float32: share of its mean error each chunk's rows are moved by

    @classmethod
    def build(cls, layout, src, src_slots, src_chunk, src_positions, dst_slots, dst_chunk, dst_positions,
              share: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> KVShiftPlan:
        num_chunks = share.shape[0]
        pages, grid = layout.page_grid(dst_slots)
        grid_chunk = torch.full((pages.numel() * layout.kernel_block_size,), num_chunks, dtype=torch.long,
                                device=dst_slots.device)
        grid_chunk[grid] = dst_chunk
        grid_pos = torch.zeros_like(grid_chunk)
        grid_pos[grid] = dst_positions
        return cls(src, src_slots, src_chunk, Rotation.of(-src_positions, cos_sin, is_neox), pages, grid_chunk,
                   Rotation.of(grid_pos, cos_sin, is_neox), share.float())

    def apply(self, layout, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Moves the left-out rows' KV in ``kv_cache``; must run before the pass's rows overwrite
        their stored KV (`key`, `value`: the pass's fresh ``[rows, kv_heads, head_size]``)."""
        if not self.src.numel() or not self.pages.numel():
            return
        stored_k, stored_v = layout.gather(kv_cache, self.src_slots)
        dk, dv, has = chunk_mean_errors(key[self.src], stored_k, value[self.src], stored_v, self.src_chunk,
                                        self.share.shape[0], self.src_unrotate)
        layout.add_pages(kv_cache, self.pages, *kv_shifts(self.grid_chunk, dk, dv, has * self.share,
                                                          self.grid_rotate))


class SubsetAttentionImpl:
    """Stands in for one layer's vLLM attention impl during a subset pass."""

    def __init__(self, inner, layout, shift: KVShiftPlan | None = None, faults: RankFaults | None = None) -> None:
        self.inner = inner
        self.layout = layout
        self.shift = shift
        self.faults = faults or RankFaults(1)

    def __getattr__(self, name):  # everything but forward and the KV write is vLLM's
        return getattr(self.inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.shift is not None:
            n, d = key.shape[0], self.inner.head_size
            self.shift.apply(self.layout, kv_cache, key.reshape(n, -1, d), value.reshape(n, -1, d))
        return self.inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, SubsetAttentionMetadata):
            return self.inner.forward(layer, query, key, value, kv_cache, attn_metadata, output=output,
                                      output_scale=output_scale, output_block_scale=output_block_scale)
        with self.faults.guarded("attention"):  # under TP a fault here waits for the others' collectives
            inject("attention")
            m = attn_metadata
            n, d = m.num_actual_tokens, self.inner.head_size
            q = query[:n].view(n, -1, d)
            out = output[:n].view(n, -1, d)
            if m.kernel is not None:
                rows = m.kernel_rows
                if rows.numel() == n:  # every row: call the kernel in place
                    self.inner.forward(layer, query, key, value, kv_cache, m.kernel, output=output)
                else:
                    part = out.new_empty(rows.numel(), out.shape[1], d)
                    self.inner.forward(layer, q[rows], key[:n][rows], value[:n][rows], kv_cache, m.kernel,
                                       output=part)
                    out[rows] = part
            for g in m.tiled:
                if g.plan is None:
                    out[g.rows] = paged_causal_attention(q[g.rows], g.positions, self.layout.pages(kv_cache),
                                                         g.kernel_blocks, self.inner.scale,
                                                         page_format=self.layout.page_format)
                else:
                    k_t, v = self.layout.gather_pages_head_major(kv_cache, g.kernel_blocks)
                    out[g.rows] = tiled_causal_attention(q[g.rows], k_t, v, g.plan, self.inner.scale)
        return output


@contextlib.contextmanager
def subset_attention(attn_layers, layout, shift: KVShiftPlan | None = None, faults: RankFaults | None = None):
    """Puts `SubsetAttentionImpl` in front of each layer's impl, for one subset pass."""
    saved = [layer.impl for layer in attn_layers]
    try:
        for layer, impl in zip(attn_layers, saved):
            layer.impl = SubsetAttentionImpl(impl, layout, shift, faults)
        yield
    finally:
        for layer, impl in zip(attn_layers, saved):
            layer.impl = impl


def _can_tile(impl, threshold: int | None) -> bool:
    """The tiled path is plain softmax attention: no window, ALiBi, soft cap or sinks."""
    return ((threshold is None or threshold > 0) and getattr(impl, "sliding_window", -1) in (-1, None)
            and getattr(impl, "alibi_slopes", None) is None and not getattr(impl, "logits_soft_cap", 0)
            and getattr(impl, "sinks", None) is None)


def _runs(pseudo: PseudoBatch, keep: torch.Tensor, run_len: torch.Tensor) -> PseudoBatch:
    """The runs of `pseudo` flagged in `keep`, as a pseudo-batch of their own."""
    lens = run_len[keep]
    qsl = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    qsl[1:] = torch.cumsum(lens, 0)
    seq_lens = pseudo.seq_lens[keep]
    return PseudoBatch(pseudo.token_indices[torch.repeat_interleave(keep, run_len)], qsl, seq_lens,
                       pseudo.run_request[keep], int(lens.max()), int(seq_lens.max()))


def _cpu_kernel_metadata(meta, pseudo: PseudoBatch, attn_layer, dtype: torch.dtype):
    from vllm import _custom_ops as ops
    from vllm import envs

    window = attn_layer.impl.sliding_window  # the CPU impl stores -1 for none
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=pseudo.num_runs,
        num_heads=attn_layer.num_heads,
        num_kv_heads=attn_layer.num_kv_heads,
        head_dim=attn_layer.head_size,
        seq_lens=pseudo.seq_lens,
        dtype=dtype,
        query_start_loc=pseudo.query_start_loc,
        causal=True,
        sliding_window_size=window,
        isa=attn_layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=attn_layer.kv_cache_dtype,
    )
    return dataclasses.replace(
        meta,
        num_actual_tokens=pseudo.num_tokens,
        max_query_len=pseudo.max_query_len,
        query_start_loc=pseudo.query_start_loc,
        max_seq_len=pseudo.max_seq_len,
        seq_lens=pseudo.seq_lens,
        block_table=meta.block_table.index_select(0, pseudo.run_request),
        slot_mapping=None,  # unused by forward; the cache write reads the forward context's
        scheduler_metadata=scheduler_metadata,
        causal=True,
        dynamic_causal=None,
        use_sdpa_prefill=False,
        num_decode_tokens=0,
        sdpa_attn_masks=None,
        sdpa_start_loc=None,
    )
