"""Blend's single forward pass over a decoder stack (Llama, Mistral, Qwen2, Qwen3 layouts).

Layers before the check layer run on every scheduled token. The fresh V of the tokens whose KV was
loaded is then taken from the check layer's norm and projection and compared with the loaded V.
With the "query" selection (default), the rows after a request's chunks (its question) first run
the check layer and the later layers over the loaded KV, and each loaded token is scored by the
attention those rows pay it times its deviation (query_probe.py); with "hkvd", by the deviation
alone. The top `ratio` of the loaded tokens, every token whose KV was not loaded (cache misses,
the suffix, tokens of other requests) and each request's last token go on through the check layer
and the remaining layers; the others keep their loaded KV from the check layer on. Attention of
the selected tokens is exactly causal over the request's whole KV (see sparse_attention.py).
"""

from __future__ import annotations

import logging

import torch

from ucm.integration.vllm.sparse_attention import subset_attention, subset_metadata
from ucm.integration.vllm.worker_side import BlendStep
from ucm.sparse.blend.hkvd import select_hkvd, token_deviation
from ucm.sparse.blend.query_probe import attention_mass, probe_query_mask, query_weighted_score
from ucm.sparse.blend.runs import pseudo_request_metadata

logger = logging.getLogger(__name__)


def blend_forward(model, step: BlendStep, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    layer_names = [name for name in fc.attn_metadata]  # one KV-cache group: one metadata object
    meta = fc.attn_metadata[layer_names[0]]
    n = int(meta.num_actual_tokens)
    hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
    residual = None
    layers = model.layers
    for layer in layers[: step.check_layer]:
        hidden, residual = layer(positions, hidden, residual)
    # `hidden`, `residual` now enter the check layer. The check layer itself runs only on the rows
    # that go on (below): the others keep their loaded KV from it on.

    slot_mapping = fc.slot_mapping[layer_names[0]][:n].long()
    qsl = meta.query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    segment = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device), qsl[1:] - qsl[:-1])[:n]

    # Batch rows whose slot holds loaded KV, and which loaded row each one is.
    table = torch.full((int(max(slot_mapping.max().item(), step.loaded_slots.max().item())) + 1,), -1,
                       dtype=torch.long, device=slot_mapping.device)
    table[step.loaded_slots] = torch.arange(step.loaded_slots.shape[0], device=slot_mapping.device)
    row = table[slot_mapping.clamp(min=0)]
    row[slot_mapping < 0] = -1
    loaded = row >= 0

    # Deviation on V, as CacheBlend's own kernels rank it: K deviation at the check layer is
    # mostly RoPE-position noise and predicts later-layer error worse (measured, see README).
    fresh_v = _check_layer_v(layers[step.check_layer], hidden[loaded], None if residual is None else residual[loaded])
    deviation = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    deviation[loaded] = token_deviation(fresh_v, step.check_v[row[loaded]])
    all_reduce = tensor_model_parallel_all_reduce if get_tensor_model_parallel_world_size() > 1 else None
    if all_reduce is not None:
        deviation = all_reduce(deviation)
    ratios = torch.zeros(num_reqs, dtype=torch.float32, device=hidden.device)
    ratios.scatter_reduce_(0, segment[loaded], step.ratios[row[loaded]], reduce="amax")
    wants_probe = torch.zeros(num_reqs, dtype=torch.bool, device=hidden.device)
    wants_probe[segment[loaded][step.query_select[row[loaded]]]] = True
    wants_probe &= (ratios > 0) & (ratios < 1)  # ratio 0 / 1 select none / all: nothing to rank
    queries = probe_query_mask(loaded, segment, num_reqs) & wants_probe[segment]
    score = deviation
    if bool(queries.any()):
        probed = torch.zeros(num_reqs, dtype=torch.bool, device=hidden.device)
        probed[segment[queries]] = True
        mass = _query_attention_mass(model, step, fc, meta, layer_names, hidden, residual, positions[:n],
                                     ~loaded & probed[segment], queries, segment)
        if all_reduce is not None:
            mass = all_reduce(mass)
        score = query_weighted_score(mass, deviation, probed[segment], positions[:n])
    hkvd = select_hkvd(score, loaded, segment, ratios, num_segments=num_reqs)
    num_selected, num_loaded = int(hkvd.sum()), int(loaded.sum())
    step.stats.add("recomputed_tokens", num_selected)
    step.stats.add("reused_tokens", num_loaded - num_selected)
    compute = ~loaded | hkvd
    compute[qsl[1:] - 1] = True  # every request's last token feeds the sampler

    pseudo = pseudo_request_metadata(compute, segment, positions[:n].long())
    logger.debug("blend: %d of %d tokens recomputed after layer %d, in %d runs", pseudo.num_tokens, n,
                 step.check_layer, pseudo.num_runs)
    idx = pseudo.token_indices
    h, r = _run_subset(layers[step.check_layer:], step.layout, fc, meta, layer_names, pseudo, slot_mapping, hidden,
                       residual, positions)
    if residual is None:  # check layer 0: rows that did not go on have no state past the embedding
        hidden, residual = hidden.clone(), torch.zeros_like(hidden)
    hidden[idx] = h  # h, r were gathered as copies: the fused add+norm never touched these rows
    residual[idx] = r
    hidden, _ = model.norm(hidden, residual)
    return hidden


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
                          sel_positions, layout.kernel_block_size)
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


def _query_attention_mass(model, step: BlendStep, fc, meta, layer_names, hidden, residual, positions, run_rows,
                          queries, segment) -> torch.Tensor:
    """Attention mass the question rows give each row of the batch, over the layers after the check layer.

    `run_rows` (every row without loaded KV of the probed requests) go through those layers over
    the loaded KV, i.e. the full-reuse state; the queries of the `queries` rows are captured at
    each attention layer and scored against the request's whole K (prefix included) read back
    from the paged cache. The KV these rows write is rewritten by the main pass, which computes
    every row without loaded KV.
    """
    n = positions.shape[0]
    slot_mapping = fc.slot_mapping[layer_names[0]][:n].long()
    pseudo = pseudo_request_metadata(run_rows, segment, positions.long())
    step.stats.add("probe_tokens", pseudo.num_tokens)
    probe_layers = range(step.check_layer + 1, len(layer_names))
    captured: dict[int, torch.Tensor] = {}
    keep = queries[pseudo.token_indices]  # which probe-pass rows are queries

    def capture(index):
        def hook(module, args, kwargs):
            query = args[0] if args else kwargs["query"]
            captured[index] = query[keep].reshape(int(keep.sum()), module.num_heads, module.head_size)
        return hook

    attns = [fc.no_compile_layers[layer_names[i]] for i in probe_layers]
    hooks = [a.register_forward_pre_hook(capture(i), with_kwargs=True) for i, a in zip(probe_layers, attns)]
    try:
        _run_subset(model.layers[step.check_layer:], step.layout, fc, meta, layer_names, pseudo, slot_mapping,
                    hidden, residual, positions)
    finally:
        for handle in hooks:
            handle.remove()

    mass = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    qsl = meta.query_start_loc.long()
    q_rows = pseudo.token_indices[keep]  # batch rows of the captured queries, in capture order
    q_seg = segment[q_rows]
    block_size = step.layout.kernel_block_size
    for req in torch.unique(q_seg).tolist():
        mine = q_seg == req
        q_pos = positions[q_rows[mine]].long()
        pages = meta.block_table[req, :(int(q_pos.max()) + block_size) // block_size].long()
        req_mass = torch.zeros(pages.shape[0] * block_size, dtype=torch.float32, device=hidden.device)
        for i, attn in zip(probe_layers, attns):
            k_t, _ = step.layout.gather_pages_head_major(step.caches[i], pages)  # whole pages: one copy
            req_mass += attention_mass(captured[i][mine], k_t.permute(2, 0, 1), q_pos, attn.impl.scale)
        first, last = int(qsl[req]), int(qsl[req + 1])
        start = int(positions[first])
        mass[first:last] = req_mass[start:start + last - first]
    return mass
