"""Blend's single forward pass over a decoder stack (Llama, Mistral, Qwen2, Qwen3 layouts).

With "hkvd", layers before the check layer run on every scheduled token; the fresh V of the
loaded tokens is then taken from the check layer's norm and projection and compared with the
loaded V (the deviation), and the tokens that deviate most are selected. With "query" (default),
those layers first run only on the rows without loaded KV: the rows after the request's chunks
(its question) then run the check layer and the later layers over the loaded KV, each loaded token
gets the attention those rows pay it per unit of cost, and the deviation is measured only for the
top candidates by that attention, which then run the layers before the check layer too
(query_probe.py). The diagnostic "oracle" first runs the batch as full prefill and ranks by the
question's attention there times each token's V error, then restores the loaded KV. Full reuse
(ratio 0) runs those layers on the uncached rows only. The selected tokens, every token whose KV
was not loaded (cache misses, the suffix, tokens of other requests) and each request's last token
go on through the check layer and the remaining layers; the others keep their loaded KV. Attention of the computed tokens is exactly causal over the request's whole
KV (see sparse_attention.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch

from ucm.config import BLEND_SELECTIONS, ORACLE_SELECTION, QUERY_SELECTION
from ucm.integration.vllm.blend.sparse_attention import subset_attention, subset_metadata
from ucm.integration.vllm.connector.worker_side import BlendStep
from ucm.sparse.blend.hkvd import select_hkvd, token_deviation
from ucm.sparse.blend.query_probe import (attention_mass, attention_per_cost, oracle_layer_score, probe_candidates,
                                          probe_query_mask, query_weighted_score)
from ucm.sparse.blend.runs import pseudo_request_metadata

logger = logging.getLogger(__name__)

# BlendStep.selection codes of the rules ranked here ("hkvd" is the fallback of the others).
_QUERY = BLEND_SELECTIONS.index(QUERY_SELECTION)
_ORACLE = BLEND_SELECTIONS.index(ORACLE_SELECTION)


def blend_forward(model, step: BlendStep, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    layer_names = [name for name in fc.attn_metadata]  # one KV-cache group: one metadata object
    batch = _with_regions(model, step, fc.attn_metadata[layer_names[0]], fc.slot_mapping[layer_names[0]],
                          input_ids, positions, inputs_embeds)
    meta, positions, slot_mapping, segment = batch.meta, batch.positions, batch.slot_mapping, batch.segment
    hidden = batch.hidden
    n = positions.shape[0]
    layers, check = model.layers, step.check_layer
    device = hidden.device
    qsl = meta.query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    last = torch.zeros(n, dtype=torch.bool, device=device)
    last[qsl[1:] - 1] = True  # every request's last token feeds the sampler

    # Rows whose slot holds loaded KV, and which loaded row each one is.
    row = torch.full((n,), -1, dtype=torch.long, device=device)
    if step.loaded_slots.numel():
        table = torch.full((int(max(slot_mapping.max().item(), step.loaded_slots.max().item())) + 1,), -1,
                           dtype=torch.long, device=slot_mapping.device)
        table[step.loaded_slots] = torch.arange(step.loaded_slots.shape[0], device=slot_mapping.device)
        row = table[slot_mapping.clamp(min=0)]
        row[slot_mapping < 0] = -1
    loaded = row >= 0

    ratios = batch.ratios
    ranked = (ratios > 0) & (ratios < 1)  # ratio 0 / 1 select none / all: nothing to rank
    question = probe_query_mask(loaded, segment, num_reqs) & (positions < batch.question_end[segment])
    queries = question & (ranked & (batch.rules == _QUERY))[segment]
    probed = _requests_with(queries, segment, num_reqs)
    oracle_queries = question & (ranked & (batch.rules == _ORACLE))[segment]
    oracled = _requests_with(oracle_queries, segment, num_reqs)
    oracle = None
    if bool(oracled.any()):  # diagnostic: before anything below touches the cache
        oracle = _oracle_score(model, step, fc, meta, layer_names, hidden, positions, slot_mapping, loaded,
                               oracle_queries, segment)
    # Loaded rows that skip the layers before the check layer for now: those of probed requests
    # (their deviation is measured on candidates only), of requests ranked by the oracle and of
    # requests reusing everything. Those layers' KV is the loaded one for them, which for layer 0
    # is exact (it depends on the token and its position alone).
    lazy = loaded & (probed | oracled | (ratios == 0))[segment]
    hidden, residual = _run_layers(layers[:check], step.layout, fc, meta, layer_names, slot_mapping, segment,
                                   positions, ~lazy, hidden, None)

    # Deviation on V, as CacheBlend's own kernels rank it: K deviation at the check layer is
    # mostly RoPE-position noise and predicts later-layer error worse (measured, see README).
    deviation = torch.zeros(n, dtype=torch.float32, device=device)
    _add_deviation(deviation, layers[check], step, row, loaded & ~lazy, hidden, residual)
    tp = get_tensor_model_parallel_world_size() > 1  # deviation and mass are per-rank partial sums over heads
    candidates = per_cost = None
    if bool(probed.any()):
        mass = _query_attention_mass(model, step, fc, meta, layer_names, hidden, residual, positions, slot_mapping,
                                     ~loaded & probed[segment], queries, segment)
        if tp:  # every rank must pick the same candidates
            mass = tensor_model_parallel_all_reduce(mass)
        per_cost = attention_per_cost(mass, positions)
        candidates = probe_candidates(per_cost, loaded, probed[segment], segment, ratios, num_segments=num_reqs)
        hidden, residual = _run_layers(layers[:check], step.layout, fc, meta, layer_names, slot_mapping, segment,
                                       positions, candidates, hidden, residual)
        _add_deviation(deviation, layers[check], step, row, candidates, hidden, residual)
        lazy &= ~candidates
    if tp:
        deviation = tensor_model_parallel_all_reduce(deviation)
    score = deviation if candidates is None else query_weighted_score(per_cost, deviation, probed[segment],
                                                                      candidates)
    if oracle is not None:
        if tp:
            oracle = tensor_model_parallel_all_reduce(oracle)
        score = torch.where(oracled[segment], oracle, score)
    hkvd = select_hkvd(score, loaded, segment, ratios, num_segments=num_reqs)
    num_selected, num_loaded = int(hkvd.sum()), int(loaded.sum())
    step.stats.add("recomputed_tokens", num_selected)
    step.stats.add("reused_tokens", num_loaded - num_selected)
    compute = ~loaded | hkvd | last
    # Selected rows are candidates, so this is only the last row of a prompt that ends inside a
    # loaded chunk reused in full.
    hidden, residual = _run_layers(layers[:check], step.layout, fc, meta, layer_names, slot_mapping, segment,
                                   positions, compute & lazy, hidden, residual)

    pseudo = pseudo_request_metadata(compute, segment, positions.long())
    logger.debug("blend: %d of %d tokens recomputed after layer %d, in %d runs", pseudo.num_tokens, n, check,
                 pseudo.num_runs)
    idx = pseudo.token_indices
    h, r = _run_subset(layers[check:], step.layout, fc, meta, layer_names, pseudo, slot_mapping, hidden,
                       residual, positions)
    if residual is None:  # check layer 0: rows that did not go on have no state past the embedding
        hidden, residual = hidden.clone(), torch.zeros_like(hidden)
    hidden[idx] = h  # h, r were gathered as copies: the fused add+norm never touched these rows
    residual[idx] = r
    # Only vLLM's rows go back, in its order (the sampler reads them); padding rows stay zero.
    rows = batch.scheduled if batch.scheduled is not None else slice(None)
    out = hidden.new_zeros(batch.num_input_rows, hidden.shape[1])
    out[:n if batch.scheduled is None else batch.scheduled.shape[0]], _ = model.norm(hidden[rows], residual[rows])
    return out


@dataclass
class _Batch:
    """The rows the Blend forward runs: vLLM's scheduled rows, each blend request's region rows
    inserted before its own (a request's rows stay contiguous and in position order, as in vLLM's
    batch), with per-request Blend settings."""

    hidden: torch.Tensor  # [n, hidden] embeddings
    positions: torch.Tensor  # [n]
    slot_mapping: torch.Tensor  # [n] int64
    meta: object  # attention metadata over these rows (vLLM's own when no region was inserted)
    segment: torch.Tensor  # [n] request index (the block-table row)
    ratios: torch.Tensor  # [num_reqs] float32, 0 for requests not blending
    rules: torch.Tensor  # [num_reqs] selection code, -1 for requests not blending
    question_end: torch.Tensor  # [num_reqs] probe queries come from positions before this
    scheduled: torch.Tensor | None  # rows of vLLM's scheduled tokens, in its order; None: all rows
    num_input_rows: int  # rows of vLLM's input (padding included)


def _with_regions(model, step: BlendStep, meta, slot_mapping, input_ids, positions, inputs_embeds) -> _Batch:
    """Builds the batch of this step's forward: vLLM's rows plus the region rows of each blend
    request, found in vLLM's batch by the slot of its first scheduled token (the V1 runner gives
    the model no request ids)."""
    n = int(meta.num_actual_tokens)
    device = positions.device
    slot_mapping = slot_mapping[:n].long()
    qsl = meta.query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    owner = {slot: i for i, slot in enumerate(slot_mapping[qsl[:-1]].tolist())}
    regions = {}
    for region in step.regions:
        if region.first_slot not in owner:
            raise RuntimeError(f"Blend: no request of this batch starts at slot {region.first_slot}")
        regions[owner[region.first_slot]] = region
    ratios = torch.zeros(num_reqs, dtype=torch.float32, device=device)
    rules = torch.full((num_reqs,), -1, dtype=torch.long, device=device)
    question_end = torch.full((num_reqs,), torch.iinfo(torch.long).max, dtype=torch.long, device=device)
    for i, region in regions.items():
        ratios[i], rules[i], question_end[i] = region.ratio, region.selection, region.question_end
    num_rows = (inputs_embeds if inputs_embeds is not None else input_ids).shape[0]  # padding included
    hidden = inputs_embeds[:n] if inputs_embeds is not None else model.embed_input_ids(input_ids[:n])
    if not any(len(r.positions) for r in regions.values()):
        segment = torch.repeat_interleave(torch.arange(num_reqs, device=device), qsl[1:] - qsl[:-1])
        return _Batch(hidden, positions[:n], slot_mapping, meta, segment, ratios, rules, question_end, None,
                      num_rows)
    lens, offset = [], 0
    region_rows, scheduled = [], []
    for i in range(num_reqs):
        m = len(regions[i].positions) if i in regions else 0
        count = int(qsl[i + 1] - qsl[i])
        if m:
            region_rows.append(torch.arange(offset, offset + m, device=device))
        scheduled.append(torch.arange(offset + m, offset + m + count, device=device))
        offset += m + count
        lens.append(m + count)
    region_rows, scheduled = torch.cat(region_rows), torch.cat(scheduled)
    ordered = [regions[i] for i in sorted(regions) if len(regions[i].positions)]
    total = offset
    out_hidden = hidden.new_empty(total, hidden.shape[1])
    out_hidden[scheduled] = hidden
    out_hidden[region_rows] = model.embed_input_ids(torch.cat([r.token_ids for r in ordered]))
    out_positions = positions.new_empty(total)
    out_positions[scheduled] = positions[:n]
    out_positions[region_rows] = torch.cat([r.positions for r in ordered]).to(positions.dtype)
    out_slots = slot_mapping.new_empty(total)
    out_slots[scheduled] = slot_mapping
    out_slots[region_rows] = torch.cat([r.slots for r in ordered])
    lens_t = torch.tensor(lens, device=device)
    new_qsl = torch.zeros(num_reqs + 1, dtype=meta.query_start_loc.dtype, device=device)
    new_qsl[1:] = torch.cumsum(lens_t, 0)
    new_meta = dataclasses.replace(meta, num_actual_tokens=total, query_start_loc=new_qsl,
                                   max_query_len=int(lens_t.max()))
    segment = torch.repeat_interleave(torch.arange(num_reqs, device=device), lens_t)
    return _Batch(out_hidden, out_positions, out_slots, new_meta, segment, ratios, rules, question_end, scheduled,
                  num_rows)


def _requests_with(rows, segment, num_reqs) -> torch.Tensor:
    """``[num_reqs]`` bool: the requests owning at least one of the ``rows`` (an ``[n]`` bool mask)."""
    owners = torch.zeros(num_reqs, dtype=torch.bool, device=rows.device)
    owners[segment[rows]] = True
    return owners


def _run_layers(layers, layout, fc, meta, layer_names, slot_mapping, segment, positions, rows, hidden, residual):
    """Runs `layers` (those before the check layer) on `rows`; returns the updated (hidden, residual).

    All of vLLM's rows: the plain stack. Otherwise a subset pass; rows that have not run yet enter with the
    embedding and a zero residual, which the first layer's fused add+norm treats exactly like no
    residual.
    """
    if len(layers) == 0 or not bool(rows.any()):
        return hidden, residual
    if bool(rows.all()) and residual is None and meta is fc.attn_metadata[layer_names[0]]:  # vLLM's own rows
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual
    pseudo = pseudo_request_metadata(rows, segment, positions[:rows.shape[0]].long())
    if residual is None:  # the embedding may be the caller's buffer: write into a copy
        hidden, residual = hidden.clone(), torch.zeros_like(hidden)
    h, r = _run_subset(layers, layout, fc, meta, layer_names, pseudo, slot_mapping, hidden, residual, positions)
    hidden[pseudo.token_indices] = h
    residual[pseudo.token_indices] = r
    return hidden, residual


def _add_deviation(deviation, check_layer, step: BlendStep, row, rows, hidden, residual) -> None:
    """Writes the check-layer V deviation of `rows` (loaded rows whose state has reached the check layer)."""
    if not bool(rows.any()):
        return
    fresh_v = _check_layer_v(check_layer, hidden[rows], None if residual is None else residual[rows])
    deviation[rows] = token_deviation(fresh_v, step.check_v[row[rows]])


def _run_subset(layers, layout, fc, meta, layer_names, pseudo, slot_mapping, hidden, residual, positions):
    """Runs `layers` on the rows of `pseudo` only, attention exactly causal over the paged KV.

    Returns new (hidden, residual) rows; the rows are gathered as copies, so the caller's tensors
    are untouched. The KV of these rows is written into the cache as each layer runs.
    """
    idx = pseudo.token_indices
    attn_layers = [fc.no_compile_layers[name] for name in layer_names]
    dtype = fc.slot_mapping[layer_names[0]].dtype
    sel_positions = positions[idx]
    sub = subset_metadata(meta, pseudo, slot_mapping.index_select(0, idx).to(dtype), attn_layers[0], hidden.dtype,
                          sel_positions, layout)
    saved_meta, saved_slots = fc.attn_metadata, fc.slot_mapping
    fc.attn_metadata = {name: sub for name in layer_names}
    fc.slot_mapping = {name: sub.slot_mapping for name in layer_names}
    try:
        h, r = hidden[idx], None if residual is None else residual[idx]
        with subset_attention(attn_layers, layout):
            for layer in layers:
                h, r = layer(sel_positions, h, r)
    finally:
        fc.attn_metadata, fc.slot_mapping = saved_meta, saved_slots
    return h, r


def _check_layer_v(layer, hidden, residual) -> torch.Tensor:
    """The check layer's fresh V of these rows (``[n, kv_heads, head_dim]``, this rank's heads).

    From the layer's own norm and QKV projection, which is all V takes in the supported
    architectures (no RoPE, no norm on V): the deviation is known before the layer runs, so its
    attention and MLP run on the selected rows only. Pass copies: the fused add+norm works in place.
    """
    attn = layer.self_attn
    normed = layer.input_layernorm(hidden) if residual is None else layer.input_layernorm(hidden, residual)[0]
    qkv, _ = attn.qkv_proj(normed)
    return qkv[:, attn.q_size + attn.kv_size:].reshape(-1, attn.num_kv_heads, attn.head_dim)


def _query_attention_mass(model, step: BlendStep, fc, meta, layer_names, hidden, residual, positions, slot_mapping,
                          run_rows, queries, segment) -> torch.Tensor:
    """Attention mass the question rows give each row of the batch, over the layers after the check layer.

    `run_rows` (every row without loaded KV of the probed requests) go through those layers over
    the loaded KV, i.e. the full-reuse state; the queries of the `queries` rows are captured at
    each attention layer and scored against the request's whole K (prefix included) read back
    from the paged cache. The KV these rows write is rewritten by the main pass, which computes
    every row without loaded KV.
    """
    n = positions.shape[0]
    pseudo = pseudo_request_metadata(run_rows, segment, positions.long())
    step.stats.add("probe_tokens", pseudo.num_tokens)
    probe_layers = range(step.check_layer + 1, len(layer_names))
    attns = [fc.no_compile_layers[layer_names[i]] for i in probe_layers]
    keep = queries[pseudo.token_indices]  # which probe-pass rows are queries
    with _captured_queries(attns, keep) as captured:
        _run_subset(model.layers[step.check_layer:], step.layout, fc, meta, layer_names, pseudo, slot_mapping,
                    hidden, residual, positions)
    q_rows = pseudo.token_indices[keep]  # batch rows of the captured queries, in capture order
    mass = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for i, attn, q in zip(probe_layers, attns, captured):
        mass += _layer_attention_mass(step.layout, step.caches[i], meta, q, q_rows, segment, positions,
                                      attn.impl.scale)
    return mass


def _oracle_score(model, step: BlendStep, fc, meta, layer_names, hidden, positions, slot_mapping, loaded, queries,
                  segment) -> torch.Tensor:
    """The "oracle" selection's score of every row (diagnostic; costs a full prefill on top).

    Runs the whole batch through every layer as full prefill would, capturing the question rows'
    queries, then scores each loaded row per layer by the attention those queries pay it times
    its V error (query_probe.oracle_layer_score), and puts the loaded KV (of the `loaded` rows)
    back, so the Blend pass that follows starts from the same cache as with any other selection.
    """
    n = segment.shape[0]
    slots = slot_mapping[loaded]
    stale = [step.layout.gather(cache, slots) for cache in step.caches]
    attns = [fc.no_compile_layers[name] for name in layer_names]
    with _captured_queries(attns, queries) as captured:
        _run_layers(model.layers, step.layout, fc, meta, layer_names, slot_mapping, segment, positions,
                    torch.ones(n, dtype=torch.bool, device=hidden.device), hidden.clone(), None)
    step.stats.add("probe_tokens", n)
    q_rows = torch.nonzero(queries).flatten()
    score = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for cache, attn, q, (k, v) in zip(step.caches, attns, captured, stale):
        mass = _layer_attention_mass(step.layout, cache, meta, q, q_rows, segment, positions, attn.impl.scale)
        _, fresh_v = step.layout.gather(cache, slots)
        score[loaded] += oracle_layer_score(mass[loaded], fresh_v, v)
        step.layout.scatter(cache, slots, k, v)
    return score


@contextlib.contextmanager
def _captured_queries(attns, keep):
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


def _layer_attention_mass(layout, cache, meta, q, q_rows, segment, positions, scale) -> torch.Tensor:
    """Attention mass queries `q` (of batch rows `q_rows`) give each batch row over one layer's
    paged K (the request's whole K, prefix included), ``[n]`` float32."""
    n = positions.shape[0]
    mass = torch.zeros(n, dtype=torch.float32, device=q.device)
    qsl = meta.query_start_loc.long()
    q_seg = segment[q_rows]
    block_size = layout.kernel_block_size
    for req in torch.unique(q_seg).tolist():
        mine = q_seg == req
        q_pos = positions[q_rows[mine]].long()
        pages = meta.block_table[req, :(int(q_pos.max()) + block_size) // block_size].long()
        k_t, _ = layout.gather_pages_head_major(cache, pages, values=False)  # one copy
        req_mass = attention_mass(q[mine], k_t.permute(2, 0, 1), q_pos, scale)
        first, last = int(qsl[req]), int(qsl[req + 1])
        start = int(positions[first])
        mass[first:last] = req_mass[start:start + last - first]
    return mass
