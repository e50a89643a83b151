"""The diagnostic "oracle" selection: ranks loaded tokens with what full prefill knows.

It costs a full prefill on top of the Blend pass, so the server refuses it unless the operator
enables it (``allow_oracle``); it measures how far a better ranking alone could go.
"""

from __future__ import annotations

import torch

from ucm.integration.vllm.blend.passes import BlendRows, captured_queries, layer_attention_mass, run_layers
from ucm.sparse.blend.query_probe import oracle_layer_score


def oracle_score(model, step, b: BlendRows, hidden, loaded, queries) -> torch.Tensor:
    """The score of every row: per layer, the attention the question rows (`queries`) pay it in
    full prefill times its V error (query_probe.oracle_layer_score).

    Runs the whole batch through every layer as full prefill would, capturing the question rows'
    queries, then puts the loaded KV (of the `loaded` rows) back, so the Blend pass that follows
    starts from the same cache as with any other selection.
    """
    n = b.segment.shape[0]
    slots = b.slot_mapping[loaded]
    stale = [step.layout.gather(cache, slots) for cache in step.caches]
    attns = b.attn_layers()
    with captured_queries(attns, queries) as captured:
        run_layers(model.layers, b, torch.ones(n, dtype=torch.bool, device=hidden.device), hidden.clone(), None)
    step.stats.add("probe_tokens", n)
    q_rows = torch.nonzero(queries).flatten()
    score = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for cache, attn, q, (k, v) in zip(step.caches, attns, captured, stale):
        mass = layer_attention_mass(b, cache, q, q_rows, attn.impl.scale)
        _, fresh_v = step.layout.gather(cache, slots)
        score[loaded] += oracle_layer_score(mass[loaded], fresh_v, v)
        step.layout.scatter(cache, slots, k, v)
    return score
