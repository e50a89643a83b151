"""Query-driven token selection: which loaded tokens the question actually reads.

HKVD ranks loaded tokens by how much their KV changed at the check layer. On small models the
deviation that matters is spread thinly over the deep layers and the check layer's ranking
overlaps it only by chance, so ranking by deviation alone often spends the budget on tokens the
answer never looks at. The probe asks the question instead: the rows that follow the loaded
chunks (the question) run through the check layer and later layers over the loaded KV, and each
loaded token gets the attention probability those rows give it, weighted per head by the norm of
its V and summed over heads and rows; over the second half of the layers (`scored_layers`) each
layer adds the token's squared share of that layer's mass (`concentrated_mass`), so the layers
that retrieve rank it. The selection ranks the loaded tokens by that score alone. The early
layers' attention is mostly local and positional, and tokens that absorb attention without
carrying content (delimiters) have small V: counting either spent the budget on tokens the
answer does not read, and left the passage holding the answer stale on Qwen2.5-1.5B
(docs/research.md, "Where the question reads"). The top candidates by attention
(CANDIDATE_FACTOR x the ratio) run the layers before the check layer, where the recomputation
of the selected ones starts. The check layer's deviation does not weigh the
ranking: multiplying by it left the passage that holds the answer stale on Qwen2.5-1.5B where
attention alone, and the oracle, did not (docs/research.md, "Attention alone"); a request without
question rows is ranked by the deviation alone (HKVD). Only the question's rows are computed twice.

The attention is not divided by the token's position (its recompute cost): that tilts the budget
towards early passages, and on Qwen2.5-1.5B it left the passage holding the answer stale when it
came late in the prompt (docs/research.md, "The query rule on a model that answers").
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ucm.sparse.blend.hkvd import select_hkvd

__all__ = ["attention_mass", "concentrated_mass", "oracle_layer_score", "probe_candidates", "probe_query_mask",
           "query_weighted_score", "rows_after_loaded", "scored_layers"]

# Question rows whose attention is summed, per request: the last ones, next to the answer; they ranked
# as well as the whole question on MuSiQue (docs/research.md, "The probe's candidates").
MAX_PROBE_QUERIES = 32


# The probe's attention counts from this share of the model's depth on (the check layer's next at
# the earliest): where a model retrieves what the question asks for.
SCORED_DEPTH = Fraction(1, 2)


def scored_layers(num_layers: int, check_layer: int) -> range:
    """The layers whose attention ranks the loaded tokens: from SCORED_DEPTH of the depth on,
    after the check layer (the probe's rows run from the check layer on)."""
    return range(max(check_layer + 1, int(SCORED_DEPTH * num_layers)), num_layers)


def concentrated_mass(per_layer: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The probe's score from each scored layer's attention mass ``[layers, n]``: per layer and
    request, each row's share of the request's mass, squared, summed over the layers. ``[n]``.

    A layer whose attention concentrates on a few tokens (one that retrieves) adds their squared
    shares in full; a layer that spreads its attention adds little. Summing the masses themselves
    let the layers with the largest V norms rank alone, whatever they read.
    """
    if per_layer.dim() != 2 or segment_ids.shape != per_layer.shape[1:]:
        raise ValueError(f"per_layer must be [layers, n] and segment_ids [n]; got {tuple(per_layer.shape)} "
                         f"and {tuple(segment_ids.shape)}")
    seg = segment_ids.to(device=per_layer.device, dtype=torch.long)
    totals = torch.zeros((per_layer.shape[0], num_segments), dtype=per_layer.dtype, device=per_layer.device)
    totals.index_add_(1, seg, per_layer)
    share = per_layer / totals[:, seg].clamp(min=torch.finfo(per_layer.dtype).tiny)
    return share.square().sum(0)


# Candidates per selected token: the top `CANDIDATE_FACTOR * ratio` of a probed request's loaded tokens
# by attention run the layers before the check layer (fresh KV there for more than the selection).
# 3 was chosen while the deviation weighed the ranking (docs/research.md, "The probe's candidates");
# 1 selects the same tokens and, at check layer 1, gave the same KL and TTFT ("Attention alone").
CANDIDATE_FACTOR = 3.0

# Bound on the float32 score buffer of one query chunk (elements): 64 MiB.
_SCORE_BUDGET = 16 * 1024 * 1024


def attention_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float, query_chunk: int | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probability each key receives, summed over queries and heads: ``[num_keys]`` float32.

    ``q`` is ``[m, q_heads, d]`` (after RoPE), ``k`` ``[num_keys, kv_heads, d]`` holding the
    request's positions ``0 .. num_keys - 1``; query i sees key j iff ``j <= q_pos[i]`` (GQA when
    q_heads is a multiple of kv_heads). Queries go in chunks to bound the ``[heads, chunk, keys]``
    score buffer (by default as many as fit in 64 MiB). Sums rather than means, so partial sums
    over tensor-parallel head shards add up.

    With ``v`` (``[num_keys, kv_heads, d]``) each head's probability is weighted by the norm of
    the key's V in that head: the size of what the token adds to the head's output, not only how
    much the head looks at it (tokens that absorb attention, such as delimiters, carry small V).
    """
    m, hq, d = q.shape
    num_keys, hkv, dk = k.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: head sizes must match and "
                         "q_heads must be a multiple of kv_heads")
    if v is not None and v.shape[:2] != (num_keys, hkv):
        raise ValueError(f"v {tuple(v.shape)} must hold the {num_keys} keys' {hkv} heads")
    if q_pos.shape != (m,):
        raise ValueError(f"q_pos must be [{m}], got {tuple(q_pos.shape)}")
    if m and int(q_pos.max()) >= num_keys:
        raise ValueError(f"a query at position {int(q_pos.max())} needs keys up to it; got {num_keys}")
    group = hq // hkv
    if query_chunk is None:  # as many queries as fit the budget, at least one
        query_chunk = max(1, _SCORE_BUDGET // max(1, hq * num_keys))
    kf = k.float().transpose(0, 1)  # [hkv, keys, d]
    key_pos = torch.arange(num_keys, device=k.device)
    mass = torch.zeros(num_keys, dtype=torch.float32, device=k.device)
    v_norm = None if v is None else v.float().norm(dim=-1).transpose(0, 1)  # [hkv, keys]
    for s in range(0, m, query_chunk):
        qc = q[s:s + query_chunk].float()
        c = qc.shape[0]
        qg = qc.reshape(c, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, c * group, d)  # [hkv, c*group, d]
        scores = torch.bmm(qg, kf.transpose(1, 2)).mul_(scale).view(hkv, c, group, num_keys)
        pos = q_pos[s:s + c].to(k.device)
        lo = int(pos.min()) + 1  # keys before lo are visible to every query of the chunk
        if lo < num_keys:
            hidden = key_pos[None, lo:] > pos[:, None]  # [c, keys - lo]
            scores[..., lo:].masked_fill_(hidden[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).sum(dim=(1, 2))  # [hkv, keys]
        mass += probs.sum(0) if v_norm is None else (probs * v_norm).sum(0)
    return mass


def probe_query_mask(
    loaded: torch.Tensor, segment_ids: torch.Tensor, num_segments: int, max_queries: int = MAX_PROBE_QUERIES,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows whose attention scores the loaded tokens: per request, the rows after its last loaded
    row (its question) that are ``eligible`` (default: all), at most the last ``max_queries`` of
    them. ``[n]`` bool. The caller makes only prompt rows eligible: a request readmitted after a
    preemption is prefilled again with the tokens it had generated, and its probe must read the
    same question rows as its first blend did.

    The probe runs every row without loaded KV of a request through the later layers over the
    loaded KV as it is, and those before the question keep the KV it wrote (the question runs
    again over the recomputed rows). So a request is probed only while those rows are no more than
    ``max(max_queries, its loaded rows)``: a long uncached text behind a short cached chunk (a new
    document after a cached system prompt) ranks by deviation alone and is computed over the
    recomputed rows, as without a probe. Rows of a request
    are contiguous and in position order (vLLM's batch layout); a request with no loaded row, or
    whose last row is loaded, gets none.
    """
    if max_queries < 1:
        raise ValueError(f"max_queries must be positive, got {max_queries}")
    n = loaded.shape[0]
    after = rows_after_loaded(loaded, segment_ids, num_segments)
    if eligible is not None:
        after &= eligible.to(after.device)
    device = loaded.device
    idx = torch.arange(n, device=device)
    seg = segment_ids.to(device=device, dtype=torch.long)
    last_row = torch.full((num_segments,), -1, dtype=torch.long, device=device)
    last_row.scatter_reduce_(0, seg[after], idx[after], reduce="amax")
    num_loaded = torch.bincount(seg[loaded], minlength=num_segments)
    num_rows = torch.bincount(seg, minlength=num_segments)
    affordable = num_rows - num_loaded <= torch.clamp(num_loaded, min=max_queries)
    return after & affordable[seg] & (idx > last_row[seg] - max_queries)


def rows_after_loaded(loaded: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per request, the rows after its last loaded row (its question): ``[n]`` bool; none for a
    request without loaded rows. Rows of a request are contiguous and in position order."""
    n = loaded.shape[0]
    if loaded.dtype != torch.bool or segment_ids.shape != (n,):
        raise ValueError("loaded must be a [n] bool tensor and segment_ids [n]")
    device = loaded.device
    idx = torch.arange(n, device=device)
    seg = segment_ids.to(device=device, dtype=torch.long)
    last_loaded = torch.full((num_segments,), -1, dtype=torch.long, device=device)
    last_loaded.scatter_reduce_(0, seg[loaded], idx[loaded], reduce="amax")
    return (last_loaded[seg] >= 0) & (idx > last_loaded[seg])


def probe_candidates(
    mass: torch.Tensor,
    loaded: torch.Tensor,
    probed: torch.Tensor,
    segment_ids: torch.Tensor,
    ratios: torch.Tensor,
    factor: float = CANDIDATE_FACTOR,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Loaded rows of probed requests whose deviation is worth measuring: per request, the top
    ``min(1, factor * ratio)`` of its loaded rows by the question's attention ``mass``. ``[n]`` bool.

    The deviation needs each token's fresh state at the check layer, i.e. the layers before it
    run over the whole context; measuring it only for the tokens the question reads most makes
    that cost proportional to the candidates instead of the prompt. ``ratios`` is per request.
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (candidates must cover the selection), got {factor}")
    widened = (ratios.double() * factor).clamp(max=1.0)
    return select_hkvd(mass, loaded & probed, segment_ids, widened, num_segments=num_segments)


def query_weighted_score(
    mass: torch.Tensor, deviation: torch.Tensor, probed: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """The selection score: the question's attention ``mass`` for candidates (the tokens it reads
    most), -1 (below every candidate) for the other rows of probed requests, ``deviation`` alone
    where the request was not probed (no question rows after its chunks).

    ``deviation`` is a squared L2 distance (`token_deviation`, summable over tensor-parallel
    shards). It does not weigh the attention: the check layer's deviation of a token says little of
    the error its stale KV puts into the answer at the deep layers, and weighing by its root ranked
    the answer's passage out where the attention alone kept it (module doc).
    """
    weighted = torch.where(candidates, mass, torch.full_like(mass, -1.0))
    return torch.where(probed, weighted, deviation)


def oracle_layer_score(mass: torch.Tensor, fresh_v: torch.Tensor, stale_v: torch.Tensor) -> torch.Tensor:
    """One layer's term of the "oracle" ranking: the attention the question pays each token under
    full prefill times the norm of the error its stale V would put into that attention, ``[n]``.

    The diagnostic selection sums it over every layer, from a full prefill run first: a ranking
    that knows what the real ones must estimate, as a reference for their quality at a ratio.
    ``mass`` is ``[n]``, ``fresh_v`` and ``stale_v`` ``[n, kv_heads, head_dim]``.
    """
    if fresh_v.shape != stale_v.shape or mass.shape != fresh_v.shape[:1]:
        raise ValueError(f"mass {tuple(mass.shape)}, fresh_v {tuple(fresh_v.shape)} and stale_v "
                         f"{tuple(stale_v.shape)} must cover the same tokens")
    return mass * (fresh_v.float() - stale_v.float()).flatten(1).norm(dim=1)
