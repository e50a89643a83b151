"""Blend's single forward pass over a decoder stack (Llama, Mistral, Qwen2, Qwen3 layouts).

With "hkvd", layers before the check layer run on every scheduled token; the fresh V of the
loaded tokens is then taken from the check layer's norm and projection and compared with the
loaded V (the deviation), and the tokens that deviate most are selected. With "query" (default),
those layers first run only on the rows without loaded KV: the rows after the request's chunks
(its question) then run the check layer and the later layers over the loaded KV, each loaded token
gets the attention those rows pay it, the top candidates by that attention run the layers before
the check layer too, and the tokens the question reads most are selected (query_probe.py); misses
before the question keep the KV the probe wrote, the question runs again.
The diagnostic "oracle" first runs the batch as full prefill and ranks by the question's
attention there times each token's V error, then restores the loaded KV. Full reuse
(ratio 0) runs those layers on the uncached rows only. The selected tokens, every token whose KV
was not loaded (cache misses, the suffix, tokens of other requests) and each request's last token
go on through the check layer and the remaining layers; the others keep their loaded KV. Attention of the computed tokens is exactly causal over the request's whole
KV (see sparse_attention.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ucm.integration.vllm.blend.forward_batch import ForwardBatch, batch_with_regions
from ucm.integration.vllm.blend.oracle import oracle_score
from ucm.integration.vllm.blend.passes import (BlendRows, captured_queries, layer_attention_mass,
                                               loaded_before_attention, run_layers, run_subset)
from ucm.integration.vllm.blend.rank_faults import RankFaults
from ucm.integration.vllm.blend.sparse_attention import KVShiftPlan
from ucm.integration.vllm.blend_step import BlendStep
from ucm.integration.vllm.faults import inject
from ucm.sparse.blend.gradual import narrowed
from ucm.sparse.blend.hkvd import select_hkvd, token_deviation, token_deviation_l1
from ucm.sparse.blend.kv_shift import shift_sources
from ucm.sparse.blend.query_probe import (concentrated_mass, probe_candidates, probe_query_mask,
                                          query_weighted_score, rows_after_loaded, scored_layers)
from ucm.sparse.blend.runs import pseudo_request_metadata
from ucm.sparse.blend.vocabulary import KEY_RULES, Selection

logger = logging.getLogger(__name__)



def _count_rows(step: BlendStep, compute: torch.Tensor, scheduled: torch.Tensor | None) -> None:
    """Counts the rows run from the check layer on beside vLLM's, and any step over the cap."""
    if scheduled is None:  # no region rows this step
        return
    beside = compute.clone()
    beside[scheduled] = False
    rows = int(beside.sum())
    step.stats.add("blend_rows", rows)
    if step.max_rows is not None and rows > step.max_rows:
        step.stats.add("blend_steps_over_cap")
        logger.warning("a Blend step ran %d rows beside vLLM's, over its cap of %d", rows, step.max_rows)


def blend_forward(model, step: BlendStep, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
    """The step's forward in phases: the batch with its region rows, the roles of its rows, the
    layers before the check layer for the rows that need them now, the ranking of the loaded rows
    (deviation at the check layer; the question's attention for the query rule), the selection,
    then the check layer and the later layers on the rows that go on."""
    from vllm.forward_context import get_forward_context

    faults = RankFaults.of_tensor_parallel_group()
    batch = batch_with_regions(model, step, get_forward_context(), input_ids, positions, inputs_embeds, faults)
    with loaded_before_attention(batch.rows.attn_layers(), step):
        return _phases(model, step, batch, faults)


def _phases(model, step: BlendStep, batch: ForwardBatch, faults: RankFaults) -> torch.Tensor:
    """blend_forward's phases, with the batch built (and, layer-wise, each layer's loads awaited)."""
    roles = _row_roles(batch, step)
    early = model.layers[:step.check_layer]
    oracle = None
    if bool(roles.oracled.any()):  # diagnostic: before anything below touches the cache
        step.wait_layers(len(model.layers) - 1)  # it reads every layer's loaded KV
        oracle = oracle_score(model, step, batch.rows, batch.hidden, roles.loaded, roles.oracle_queries)
    hidden, residual = run_layers(early, batch.rows, ~roles.deferred, batch.hidden, None)
    score, candidates, mass, hidden, residual = _score_loaded_rows(model, step, batch, roles, hidden, residual,
                                                                   oracle)
    deferred = roles.deferred if candidates is None else roles.deferred & ~candidates
    compute = None
    with faults.guarded("selection"):
        compute = _rows_to_compute(step, batch, roles, _select(step, batch, roles, score))
    faults.settle()  # the rows every later collective runs over: every rank must have chosen them
    # Selected rows are candidates, so this is only the last row of a prompt that ends inside a
    # loaded chunk reused in full.
    hidden, residual = run_layers(early, batch.rows, compute & deferred, hidden, residual)
    return _run_from_check_layer(model, step, batch, roles, compute, hidden, residual, mass)


@dataclass
class _RowRoles:
    """What each row of the batch is to the phases of the forward (``[n]`` bool unless noted)."""

    loaded: torch.Tensor  # its slot holds loaded KV
    loaded_index: torch.Tensor  # [n] long: which loaded row it is (-1: not loaded)
    last: torch.Tensor  # its request's last row (the sampler reads it)
    probe_queries: torch.Tensor  # question rows of requests ranked by the query rule
    probed: torch.Tensor  # [num_reqs] requests ranked by the query rule that have question rows
    probe_rows: torch.Tensor  # rows without loaded KV of probed requests: the probe runs them over the loaded KV
    oracle_queries: torch.Tensor  # question rows of requests ranked by the oracle
    oracled: torch.Tensor  # [num_reqs]
    at_starts: torch.Tensor  # [num_reqs] requests that recompute their chunks' first tokens only
    # Loaded rows that skip the layers before the check layer for now: those of probed requests
    # (only their candidates run them, after the probe), of requests ranked by the oracle, of
    # requests reusing everything and of "chunk_start" requests (no deviation measured). Those
    # layers' KV is the loaded one for them, which for layer 0 is exact (it depends on the token
    # and its position alone).
    deferred: torch.Tensor


def _row_roles(batch: ForwardBatch, step: BlendStep) -> _RowRoles:
    b = batch.rows
    positions, segment, slot_mapping = b.positions, b.segment, b.slot_mapping
    n, device = positions.shape[0], positions.device
    qsl = b.meta.query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    last = torch.zeros(n, dtype=torch.bool, device=device)
    last[qsl[1:] - 1] = True
    loaded_index = torch.full((n,), -1, dtype=torch.long, device=device)
    if step.loaded_slots.numel():
        table = torch.full((int(max(slot_mapping.max().item(), step.loaded_slots.max().item())) + 1,), -1,
                           dtype=torch.long, device=slot_mapping.device)
        table[step.loaded_slots] = torch.arange(step.loaded_slots.shape[0], device=slot_mapping.device)
        loaded_index = table[slot_mapping.clamp(min=0)]
        loaded_index[slot_mapping < 0] = -1
    loaded = loaded_index >= 0
    ratios = batch.ratios
    ranked = (ratios > 0) & (ratios < 1)  # ratio 0 / 1 select none / all: nothing to rank
    question = probe_query_mask(loaded, segment, num_reqs, eligible=positions < batch.question_end[segment])
    probe_queries = question & (ranked & (batch.rules == Selection.QUERY))[segment]
    probed = _requests_with(probe_queries, segment, num_reqs)
    oracle_queries = question & (ranked & (batch.rules == Selection.ORACLE))[segment]
    oracled = _requests_with(oracle_queries, segment, num_reqs)
    at_starts = batch.rules == Selection.CHUNK_START
    deferred = loaded & (probed | oracled | (ratios == 0) | at_starts)[segment]
    return _RowRoles(loaded, loaded_index, last, probe_queries, probed, ~loaded & probed[segment], oracle_queries,
                     oracled, at_starts, deferred)


def _score_loaded_rows(model, step: BlendStep, batch: ForwardBatch, roles: _RowRoles, hidden, residual, oracle):
    """Each loaded row's selection score, the probe's candidates and the question's attention
    mass over the rows (both None without probed requests).

    Deviation on V, as CacheBlend's own kernels rank it: K deviation at the check layer is mostly
    RoPE-position noise and predicts later-layer error worse (the key rules measure it anyway).
    Deviation and attention mass are per-rank partial sums over heads under tensor parallelism:
    all-reduced, so every rank selects the same rows."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    b, check_layer = batch.rows, model.layers[step.check_layer]
    num_reqs = batch.ratios.shape[0]
    deviation = torch.zeros(b.positions.shape[0], dtype=torch.float32, device=hidden.device)
    rule_of_row = batch.rules[b.segment]
    with b.faults.guarded("deviation"):
        _add_deviation(deviation, check_layer, step, b, rule_of_row, roles.loaded_index,
                       roles.loaded & ~roles.deferred, hidden, residual)
    tp = get_tensor_model_parallel_world_size() > 1
    candidates = mass = None
    if bool(roles.probed.any()):
        per_layer = _query_attention_mass(model, step, b, hidden, residual, roles.probe_rows, roles.probe_queries)
        if tp:  # the shares need every head's mass
            per_layer = tensor_model_parallel_all_reduce(per_layer)
        mass = concentrated_mass(per_layer, b.segment, num_reqs)
        candidates = probe_candidates(mass, roles.loaded, roles.probed[b.segment], b.segment, batch.ratios,
                                      num_segments=num_reqs)
        # The candidates start their recomputation here; the attention alone ranks them, so no
        # deviation is measured for them (query_weighted_score).
        hidden, residual = run_layers(model.layers[:step.check_layer], b, candidates, hidden, residual)
    if tp:
        deviation = tensor_model_parallel_all_reduce(deviation)
    score = deviation if candidates is None else query_weighted_score(mass, deviation, roles.probed[b.segment],
                                                                      candidates)
    if oracle is not None:
        if tp:
            oracle = tensor_model_parallel_all_reduce(oracle)
        score = torch.where(roles.oracled[b.segment], oracle, score)
    return score, candidates, mass, hidden, residual


def _select(step: BlendStep, batch: ForwardBatch, roles: _RowRoles, score: torch.Tensor) -> torch.Tensor:
    """The loaded rows recomputed: each request's top ratio by score, chunk-start rows (EPIC)
    and the KV shift's sample rows first (within the ratio) and, for "chunk_start" requests, alone."""
    segment = batch.rows.segment
    score = torch.where(batch.near_chunk_start | batch.shift_sample[0], torch.full_like(score, float("inf")), score)
    inject("select")
    selected = select_hkvd(score, roles.loaded & ~roles.at_starts[segment], segment, batch.ratios,
                           num_segments=batch.ratios.shape[0])
    selected |= roles.loaded & batch.near_chunk_start
    num_selected, num_loaded = int(selected.sum()), int(roles.loaded.sum())
    step.stats.add("recomputed_tokens", num_selected)
    step.stats.add("reused_tokens", num_loaded - num_selected)
    return selected


def _rows_to_compute(step: BlendStep, batch: ForwardBatch, roles: _RowRoles, selected: torch.Tensor) -> torch.Tensor:
    """Rows that go through the check layer and the later layers: every row without loaded KV,
    the selected ones and each request's last row, less the misses the probe already computed.

    Misses between loaded chunks keep the KV the probe wrote (running them twice costs a blended
    request about as much as its misses: docs/research.md, "The probe's second pass"). The
    question, every row after the last loaded one and not only the rows the probe scored, runs
    again over the recomputed and shifted KV: the answer reads it most."""
    segment = batch.rows.segment
    kept = roles.probe_rows & ~rows_after_loaded(roles.loaded, segment, batch.ratios.shape[0]) & ~roles.last
    if batch.scheduled is None:  # every row is vLLM's
        kept[:] = False
    else:
        kept[batch.scheduled] = False
    compute = (~roles.loaded & ~kept) | selected | roles.last
    _count_rows(step, compute | roles.probe_rows, batch.scheduled)
    return compute


def _run_from_check_layer(model, step: BlendStep, batch: ForwardBatch, roles: _RowRoles, compute, hidden,
                          residual, mass=None) -> torch.Tensor:
    """The check layer and the later layers on the `compute` rows over the loaded (and shifted)
    KV of the others, narrowing the rows at each later check layer (`step.narrowing`); returns
    the final norm of vLLM's rows, in its order."""
    b = batch.rows
    with b.faults.guarded("forward"):
        inject("forward")
    start = step.check_layer
    for end, ratio in [*step.narrowing, (len(model.layers), None)]:
        pseudo = pseudo_request_metadata(compute, b.segment, b.positions.long())
        logger.debug("blend: %d of %d tokens recomputed in layers %d..%d, in %d runs", pseudo.num_tokens,
                     b.positions.shape[0], start, end - 1, pseudo.num_runs)
        idx = pseudo.token_indices
        shift = None
        with b.faults.guarded("KV shift"):
            shift = _kv_shift_plan(batch, step, roles.loaded & ~compute, idx, roles.loaded[idx])
        h, r = run_subset(model.layers[start:end], b, pseudo, hidden, residual, shift)
        if residual is None:  # check layer 0: rows that did not go on have no state past the embedding
            hidden, residual = hidden.clone(), torch.zeros_like(hidden)
        hidden[idx] = h  # h, r were gathered as copies: the fused add+norm never touched these rows
        residual[idx] = r
        if ratio is not None:
            compute = _narrow(model.layers[end], end, step, batch, roles, compute, hidden, residual, ratio, mass)
            start = end
    # Only vLLM's rows go back, in its order (the sampler reads them); padding rows stay zero.
    rows = batch.scheduled if batch.scheduled is not None else slice(None)
    out = hidden.new_zeros(batch.num_input_rows, hidden.shape[1])
    n = b.positions.shape[0]
    out[:n if batch.scheduled is None else batch.scheduled.shape[0]], _ = model.norm(hidden[rows], residual[rows])
    b.faults.settle()  # a fault on any rank since the selection: every rank falls back
    return out


def _narrow(layer, layer_index: int, step: BlendStep, batch: ForwardBatch, roles: _RowRoles, compute, hidden, residual,
            ratio: float, mass) -> torch.Tensor:
    """CacheBlend's gradual filtering at a later check layer: the loaded rows still recomputed are
    ranked again by their V deviation there (weighted by the question's attention for probed
    requests, as at the first check layer), and each request keeps the top `ratio` of its loaded
    rows (at most its own ratio); the others keep their loaded KV from this layer on. Each
    request's last row and its chunk-start rows stay. Returns the narrowed `compute`."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    b = batch.rows
    ranked = roles.loaded & compute & ~roles.last & ~batch.near_chunk_start
    if not bool(ranked.any()):
        return compute
    deviation = torch.zeros(b.positions.shape[0], dtype=torch.float32, device=hidden.device)
    step.wait_layers(layer_index)
    with b.faults.guarded("narrowing"):
        stale_v = step.layout.gather(step.caches[layer_index], b.slot_mapping[ranked])[1]  # not yet overwritten
        with b.lora_rows(torch.nonzero(ranked).flatten()):
            _, fresh_v = _check_layer_kv(layer, hidden[ranked], residual[ranked], None)
        deviation[ranked] = token_deviation(fresh_v, stale_v.to(fresh_v.dtype))
    if get_tensor_model_parallel_world_size() > 1:
        deviation = tensor_model_parallel_all_reduce(deviation)
    score = deviation if mass is None else torch.where(
        roles.probed[b.segment], mass * deviation.clamp(min=0).sqrt(), deviation)
    keep = ranked
    with b.faults.guarded("narrowing"):
        keep = narrowed(score, ranked, roles.loaded & compute & ~ranked, roles.loaded, b.segment, batch.ratios,
                        ratio)
    b.faults.settle()  # the narrowed rows are the next collectives' shape
    step.stats.add("narrowed_tokens", int(ranked.sum()) - int(keep.sum()))
    return compute & ~(ranked & ~keep)


def _kv_shift_plan(batch: ForwardBatch, step: BlendStep, left_out: torch.Tensor, idx: torch.Tensor,
                   idx_loaded: torch.Tensor) -> KVShiftPlan | None:
    """The main pass's chunk-mean KV shift: its loaded rows (`idx_loaded` over the pass rows `idx`)
    estimate each chunk's error (only its sample rows where the request samples and the chunk has
    one in the pass), the loaded rows `left_out` of chunks with an estimate are moved; None when
    nothing moves (no request shifts, or none recomputes a loaded row: full reuse)."""
    chunk, shares = batch.chunk_of
    if not shares.numel() or step.rope is None:
        return None
    b = batch.rows
    sample, sampling = (m[idx] for m in batch.shift_sample)
    recomputed_chunk = torch.where(idx_loaded, chunk[idx], chunk.new_tensor(-1))
    src = torch.nonzero(shift_sources(recomputed_chunk, sample, sampling, shares.shape[0])).flatten()
    src_rows = idx[src]
    estimated = torch.zeros(shares.shape[0] + 1, dtype=torch.bool, device=chunk.device)
    estimated[chunk[src_rows]] = True  # index -1 (rows outside the chunks) lands on the spare last slot
    dst = left_out & (chunk >= 0) & estimated[chunk]
    moved = int(dst.sum())
    if not moved:
        return None
    step.stats.add("kv_shifted_tokens", moved)
    return KVShiftPlan.build(step.layout, src, b.slot_mapping[src_rows], chunk[src_rows], b.positions[src_rows].long(),
                             b.slot_mapping[dst], chunk[dst], b.positions[dst].long(), shares, *step.rope)


def _requests_with(rows, segment, num_reqs) -> torch.Tensor:
    """``[num_reqs]`` bool: the requests owning at least one of the ``rows`` (an ``[n]`` bool mask)."""
    owners = torch.zeros(num_reqs, dtype=torch.bool, device=rows.device)
    owners[segment[rows]] = True
    return owners


def _add_deviation(deviation, check_layer, step: BlendStep, b: BlendRows, rule_of_row, row, rows, hidden,
                   residual) -> None:
    """Writes the check-layer deviation of `rows` (loaded rows whose state has reached the check
    layer): of V (every rule but the key rules), of K after RoPE (KEY_L2: squared, KEY_L1: absolute)."""
    if not bool(rows.any()):
        return
    rule = rule_of_row[rows]
    on_key = torch.isin(rule, torch.tensor(KEY_RULES, device=rule.device))
    keyed = bool(on_key.any())
    with b.lora_rows(torch.nonzero(rows).flatten()):
        fresh_k, fresh_v = _check_layer_kv(check_layer, hidden[rows], None if residual is None else residual[rows],
                                           b.positions[rows] if keyed else None)
    loaded = row[rows]
    dev = token_deviation(fresh_v, step.check_v[loaded])
    if keyed:
        k, k0 = fresh_k[on_key], step.check_k[loaded[on_key]]
        dev[on_key] = torch.where(rule[on_key] == Selection.KEY_L1, token_deviation_l1(k, k0), token_deviation(k, k0))
    deviation[rows] = dev


def _check_layer_kv(layer, hidden, residual, positions) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The check layer's fresh K (after its norm and RoPE; only when `positions` are given) and V
    of these rows (``[n, kv_heads, head_dim]`` each, this rank's heads).

    From the layer's own norm, QKV projection and rotary embedding, which is all K and V take in
    the supported architectures: the deviation is known before the layer runs, so its attention
    and MLP run on the selected rows only. Pass copies: the fused add+norm works in place.
    """
    attn = layer.self_attn
    normed = layer.input_layernorm(hidden) if residual is None else layer.input_layernorm(hidden, residual)[0]
    qkv, _ = attn.qkv_proj(normed)
    shape = (-1, attn.num_kv_heads, attn.head_dim)
    v = qkv[:, attn.q_size + attn.kv_size:].reshape(shape)
    if positions is None:
        return None, v
    q = qkv[:, :attn.q_size].contiguous()
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].contiguous()
    if hasattr(attn, "k_norm"):  # Qwen3: per-head RMSNorm on K before RoPE
        k = attn.k_norm(k.reshape(shape)).reshape(k.shape).contiguous()
    _, k = attn.rotary_emb(positions, q, k)
    return k.reshape(shape), v


def _query_attention_mass(model, step: BlendStep, b: BlendRows, hidden, residual, run_rows,
                          queries) -> torch.Tensor:
    """Attention mass the question rows give each row of the batch, weighted by each row's V norm,
    in each of the deep layers that rank (query_probe.scored_layers): ``[layers, n]``.

    `run_rows` (every row without loaded KV of the probed requests) go through the check layer and
    every later one over the loaded KV, i.e. the full-reuse state; the queries of the `queries` rows
    are captured at each scored attention layer and scored against the request's whole K and V
    (prefix included) read back from the paged cache. Rows before the question keep the KV they
    write here; the main pass runs the question's rows and vLLM's scheduled rows again.
    """
    n = b.positions.shape[0]
    pseudo = pseudo_request_metadata(run_rows, b.segment, b.positions.long())
    step.stats.add("probe_tokens", pseudo.num_tokens)
    layers = scored_layers(len(b.layer_names), step.check_layer)
    attns = b.attn_layers()[layers.start:layers.stop]
    keep = queries[pseudo.token_indices]  # which probe-pass rows are queries
    with captured_queries(attns, keep) as captured:
        run_subset(model.layers[step.check_layer:], b, pseudo, hidden, residual)
    q_rows = pseudo.token_indices[keep]  # batch rows of the captured queries, in capture order
    mass = torch.zeros((len(layers), n), dtype=torch.float32, device=hidden.device)
    with b.faults.guarded("probe"):
        for row, (i, attn, q) in enumerate(zip(layers, attns, captured)):
            mass[row] = layer_attention_mass(b, step.caches[i], q, q_rows, attn.impl.scale, weigh_by_values=True)
    return mass
