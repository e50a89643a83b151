"""The passes a Blend forward is made of: layers run over a subset of the batch's rows, with
attention exactly causal over the request's whole paged KV, and the attention that chosen
rows' queries pay every row (the question probe and the oracle rank with it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ucm.integration.vllm.blend.lora_rows import LoraRows, within
from ucm.integration.vllm.blend.rank_faults import RankFaults
from ucm.integration.vllm.blend.sparse_attention import KVShiftPlan, subset_attention, subset_metadata
from ucm.sparse.blend.query_probe import attention_mass
from ucm.sparse.blend.tiled_attention import native_mass_supported, paged_attention_mass
from ucm.sparse.blend.runs import PseudoBatch, pseudo_request_metadata


@dataclass
class BlendRows:
    """The rows of one Blend forward and what every pass over them shares."""

    fc: object  # vLLM's forward context: each pass swaps in its own attention metadata and slots
    layer_names: list[str]  # the attention layers, in order (one KV-cache group)
    layout: object  # the KV cache layout (ucm.integration.vllm.kv_layout)
    meta: object  # attention metadata over these rows (vLLM's own when no region was inserted)
    positions: torch.Tensor  # [n]
    slot_mapping: torch.Tensor  # [n] int64
    segment: torch.Tensor  # [n] request index (the block-table row)
    lora: LoraRows | None  # each row's adapter, None without LoRA
    faults: RankFaults | None = None  # where one rank's fault waits for the others (tensor parallelism)

    @property
    def is_vllm_batch(self) -> bool:
        """These are exactly the rows vLLM scheduled (its metadata and LoRA mapping apply as is)."""
        return self.meta is self.fc.attn_metadata[self.layer_names[0]]

    def attn_layers(self) -> list:
        return [self.fc.no_compile_layers[name] for name in self.layer_names]

    def lora_rows(self, index: torch.Tensor):
        """Context in which vLLM's LoRA layers see the rows `index` as the batch."""
        return within(self.lora, index)


def run_layers(layers, b: BlendRows, rows: torch.Tensor, hidden, residual):
    """Runs `layers` on the `rows` mask; returns the updated (hidden, residual).

    All of vLLM's rows: the plain stack. Otherwise a subset pass; rows that have not run yet enter
    with the embedding and a zero residual, which the first layer's fused add+norm treats exactly
    like no residual.
    """
    if len(layers) == 0 or not bool(rows.any()):
        return hidden, residual
    if bool(rows.all()) and residual is None and b.is_vllm_batch:
        with b.lora_rows(torch.arange(rows.shape[0], device=rows.device)):  # vLLM's mapping may be padded
            for layer in layers:
                hidden, residual = layer(b.positions, hidden, residual)
        return hidden, residual
    pseudo = pseudo_request_metadata(rows, b.segment, b.positions[:rows.shape[0]].long())
    if residual is None:  # the embedding may be the caller's buffer: write into a copy
        hidden, residual = hidden.clone(), torch.zeros_like(hidden)
    h, r = run_subset(layers, b, pseudo, hidden, residual)
    hidden[pseudo.token_indices] = h
    residual[pseudo.token_indices] = r
    return hidden, residual


def run_subset(layers, b: BlendRows, pseudo: PseudoBatch, hidden, residual, shift: KVShiftPlan | None = None):
    """Runs `layers` on the rows of `pseudo` only, attention exactly causal over the paged KV.

    Returns new (hidden, residual) rows; the rows are gathered as copies, so the caller's tensors
    are untouched. The KV of these rows is written into the cache as each layer runs (after
    `shift` moved the KV of the loaded rows left out, when given).
    """
    idx = pseudo.token_indices
    attn_layers = b.attn_layers()
    fc = b.fc
    dtype = fc.slot_mapping[b.layer_names[0]].dtype
    sel_positions = b.positions[idx]
    sub = subset_metadata(b.meta, pseudo, b.slot_mapping.index_select(0, idx).to(dtype), attn_layers[0],
                          hidden.dtype, sel_positions, b.layout)
    saved_meta, saved_slots = fc.attn_metadata, fc.slot_mapping
    fc.attn_metadata = {name: sub for name in b.layer_names}
    fc.slot_mapping = {name: sub.slot_mapping for name in b.layer_names}
    try:
        h, r = hidden[idx], None if residual is None else residual[idx]
        with subset_attention(attn_layers, b.layout, shift, b.faults), b.lora_rows(idx):
            for layer in layers:
                h, r = layer(sel_positions, h, r)
    finally:
        fc.attn_metadata, fc.slot_mapping = saved_meta, saved_slots
    return h, r


@contextlib.contextmanager
def loaded_before_attention(attns, step):
    """Layer-wise loading: each attention layer (`attns`, in layer order) first waits for its
    loaded KV to be placed (`BlendStep.wait_layers`), whichever pass runs it."""
    if step.layers_ready is None:
        yield
        return

    def wait(index):
        return lambda module, args: step.wait_layers(index)

    hooks = [a.register_forward_pre_hook(wait(i)) for i, a in enumerate(attns)]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()


@contextlib.contextmanager
def captured_queries(attns, keep):
    """Collects, in order, each attention layer's queries of the `keep` rows of the pass run inside
    (``[rows, heads, head_size]`` each, after RoPE)."""
    captured: dict[int, torch.Tensor] = {}

    def capture(index):
        def hook(module, args, kwargs):
            query = args[0] if args else kwargs["query"]
            captured[index] = query[keep].reshape(int(keep.sum()), module.num_heads, module.head_size)
        return hook

    out: list[torch.Tensor] = []
    hooks = [a.register_forward_pre_hook(capture(i), with_kwargs=True) for i, a in enumerate(attns)]
    try:
        yield out
    finally:
        for handle in hooks:
            handle.remove()
    out.extend(captured[i] for i in range(len(attns)))


def layer_attention_mass(b: BlendRows, cache, q, q_rows, scale, weigh_by_values: bool = False) -> torch.Tensor:
    """Attention mass queries `q` (of batch rows `q_rows`) give each batch row over one layer's
    paged K (the request's whole K, prefix included), ``[n]`` float32; each head's share weighted
    by the row's V norm there with `weigh_by_values` (query_probe.attention_mass)."""
    positions, segment = b.positions, b.segment
    mass = torch.zeros(positions.shape[0], dtype=torch.float32, device=q.device)
    qsl = b.meta.query_start_loc.long()
    q_seg = segment[q_rows]
    block_size = b.layout.kernel_block_size
    for req in torch.unique(q_seg).tolist():
        mine = q_seg == req
        q_pos = positions[q_rows[mine]].long()
        first, last = int(qsl[req]), int(qsl[req + 1])
        # Keys up to the request's last row (rows after its queries, such as the generated tokens of
        # a request prefilled again after a preemption, get no attention but keep the row count).
        pages = b.meta.block_table[req, :(int(positions[last - 1]) + block_size) // block_size].long()
        if native_mass_supported(cache.dtype, q.shape[-1], block_size, cache.device, b.layout.page_format):
            # Keys up to the last query's position, read in place.
            req_mass = paged_attention_mass(q[mine], q_pos, b.layout.pages(cache), pages, scale,
                                            page_format=b.layout.page_format, weigh_by_values=weigh_by_values)
        else:
            k_t, v = b.layout.gather_pages_head_major(cache, pages, values=weigh_by_values)  # one copy each
            req_mass = attention_mass(q[mine], k_t.permute(2, 0, 1), q_pos, scale,
                                      v=None if v is None else v.transpose(0, 1))
        start = int(positions[first])
        got = req_mass[start:start + last - first]  # keys past the last query's position: none
        mass[first:first + got.numel()] = got
    return mass
