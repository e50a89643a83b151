"""Blend's single forward pass over a decoder stack (Llama, Mistral, Qwen2, Qwen3 layouts).

Layers up to the check layer run on every scheduled token. There, the fresh K of the tokens
whose KV was loaded is compared with the loaded, position-shifted K; the top `ratio` of them
by deviation (HKVD), every token whose KV was not loaded (cache misses, the suffix, tokens of
other requests) and each request's last token go on through the remaining layers. The others
keep their loaded KV. Attention of the selected tokens is exactly causal over the request's
whole KV through pseudo-requests (see sparse_attention.py).
"""

from __future__ import annotations

import logging

import torch

from ucm.integration.vllm.sparse_attention import subset_metadata
from ucm.integration.vllm.worker_side import BlendStep
from ucm.sparse.blend.hkvd import select_hkvd, token_deviation
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
    for layer in layers[: step.check_layer + 1]:
        hidden, residual = layer(positions, hidden, residual)

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

    fresh_k, _ = step.layout.gather(step.check_cache, slot_mapping[loaded])
    deviation = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    deviation[loaded] = token_deviation(fresh_k, step.check_k[row[loaded]])
    all_reduce = tensor_model_parallel_all_reduce if get_tensor_model_parallel_world_size() > 1 else None
    ratios = torch.zeros(num_reqs, dtype=torch.float32, device=hidden.device)
    ratios.scatter_reduce_(0, segment[loaded], step.ratios[row[loaded]], reduce="amax")
    hkvd = select_hkvd(deviation, loaded, segment, ratios, all_reduce=all_reduce, num_segments=num_reqs)
    num_selected, num_loaded = int(hkvd.sum()), int(loaded.sum())
    step.stats.add("recomputed_tokens", num_selected)
    step.stats.add("reused_tokens", num_loaded - num_selected)
    compute = ~loaded | hkvd
    compute[qsl[1:] - 1] = True  # every request's last token feeds the sampler

    pseudo = pseudo_request_metadata(compute, segment, positions[:n].long())
    logger.debug("blend: %d of %d tokens recomputed after layer %d, in %d runs", pseudo.num_tokens, n,
                 step.check_layer, pseudo.num_runs)
    idx = pseudo.token_indices
    attn_layer = fc.no_compile_layers[layer_names[0]]
    sub = subset_metadata(meta, pseudo, slot_mapping.index_select(0, idx).to(fc.slot_mapping[layer_names[0]].dtype),
                          attn_layer, hidden.dtype)
    saved_meta, saved_slots = fc.attn_metadata, fc.slot_mapping
    fc.attn_metadata = {name: sub for name in layer_names}
    fc.slot_mapping = {name: sub.slot_mapping for name in layer_names}
    try:
        h, r = hidden[idx], residual[idx]
        sel_positions = positions[idx]
        for layer in layers[step.check_layer + 1:]:
            h, r = layer(sel_positions, h, r)
    finally:
        fc.attn_metadata, fc.slot_mapping = saved_meta, saved_slots
    hidden[idx] = h  # h, r were gathered as copies: the fused add+norm never touched these rows
    residual[idx] = r
    hidden, _ = model.norm(hidden, residual)
    return hidden
