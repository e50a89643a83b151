"""A request's chunks and its Blend region: where its chunks are, how far the region it blends
reaches under one step's cap, with which settings, and why it does not blend when it does not."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ucm.config import CHUNK_LENGTHS_PARAM
from ucm.integration.vllm.connector.metadata import BlendRegion, BlockLoad, ChunkPrefetch
from ucm.integration.vllm.connector.request_params import RequestParamPolicy
from ucm.integration.vllm.connector.request_state import RequestState
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.connector.store_view import KeySpace, StoreView
from ucm.sparse.blend.chunk_refs import ref_pieces
from ucm.sparse.blend.chunking import ChunkLayout, split_by_lengths, split_by_separator
from ucm.sparse.blend.plan import ChunkBlock, blend_region_end, bounded_region_end, region_hit_share, region_work
from ucm.store.keys import KeyKind

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm.config import BlendConfig

logger = logging.getLogger(__name__)

# A step stages at most this many loaded tokens per row of its Blend cap (max_step_tokens): at ratio
# 0.15 a region of loaded chunks alone needs about 1 / 0.15 = 6.7.
STAGED_PER_ROW = 8


def chunk_layout(request: Request, params: dict, blend: BlendConfig, stats: UCMConnectorStats) -> ChunkLayout | None:
    """The request's chunks: by the lengths it sent (`ucm_chunk_lengths`) or by the chunk end
    token (or separator); None when it has none, or its KV depends on more than its token ids (multimodal)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        # Their KV depends on more than the token ids our chunk keys hash: never shared.
        stats.add("blend_skipped_multimodal")
        return None
    tokens = request.prompt_token_ids or []
    lengths = params.get(CHUNK_LENGTHS_PARAM)
    if lengths is not None:
        try:
            return split_by_lengths(len(tokens), lengths)
        except ValueError as exc:
            logger.warning("request %s: ignoring %s (%s); computing it normally",
                           request.request_id, CHUNK_LENGTHS_PARAM, exc)
            return None
    if blend.chunk_end is None:
        return None
    layout = split_by_separator(tokens, blend.chunk_end)
    return layout if layout.chunks else None


def choose_region(state: RequestState, params: dict, policy: RequestParamPolicy, min_hit_share: float,
                  step_cap: int) -> None:
    """Sets the request's Blend region (`blend_end`) and its settings, or the fallback that says
    why it does not (wholly) blend; the fallback is counted at the request's first step."""
    plan, request_id = state.plan, state.request.request_id
    end = blend_region_end(plan, state.prompt_len)
    if end > plan.prefix_tokens and region_hit_share(plan, end) < min_hit_share:
        state.fallback = "few_hits"  # vLLM computes it
        return
    ratio = policy.ratio(request_id, params)
    # A region with more work than one step's cap is cut; vLLM's chunked prefill does the rest.
    state.blend_end = bounded_region_end(plan, end, ratio, step_cap, STAGED_PER_ROW * step_cap)
    if state.blend_end < end:
        state.fallback = "region_cut"
    if not any(b.placed.start < state.blend_end for b in plan.loaded):
        state.blend_end = plan.prefix_tokens  # nothing loaded left in it: vLLM computes it all
    if state.blending:
        chosen = policy.blend_params(request_id, params, ratio)
        state.ratio, state.selection = chosen.ratio, chosen.selection
        state.chunk_start_tokens, state.kv_shift = chosen.chunk_start_tokens, chosen.kv_shift
        state.kv_shift_sample = chosen.kv_shift_sample
        state.work = region_work(plan, state.blend_end, state.ratio)
        state.staged = sum(len(b.placed) for b in plan.loaded if b.placed.start < state.blend_end)


def chunk_loads(loaded: list[ChunkBlock], keys: KeySpace, view: StoreView, count: bool = True) -> list[BlockLoad]:
    """The loads of a blended request's chunk blocks: each stored block whole, or through its
    reference, the rows it names from the exact blocks that hold them (K moved by the offset)."""
    loads = []
    for blk in loaded:
        if blk.ref is None:
            loads.append(BlockLoad(keys.key(blk.kind, blk.block_hash), blk.tokens.start, len(blk.tokens),
                                   blk.chunk_start, blk.skip))
            continue
        if count:
            view.stats.add("chunk_ref_hit_blocks")
        for piece in ref_pieces(blk.ref, blk.placed, blk.tokens.start):
            loads.append(BlockLoad(keys.key(KeyKind.EXACT, piece.source), piece.start, len(piece.rows),
                                   piece.rope_delta, rows_from=piece.rows.start, stored_tokens=view.block_size))
    return loads


def first_blend_step(state: RequestState, num_computed: int, local: int, view: StoreView,
                     stats: UCMConnectorStats) -> tuple[BlendRegion | None, list[BlockLoad]]:
    """The Blend region of the request's first step and the chunk blocks it loads. vLLM may take
    fewer external tokens than offered (`local` cached here, `num_computed` counted as computed):
    the region then ends where vLLM's count does, and the request reports the trim."""
    plan = state.plan
    if num_computed != state.blend_end or local + state.prefix_external != plan.prefix_tokens:
        logger.warning("request %s: vLLM counts %d tokens computed, the Blend region ends at %d",
                       state.request.request_id, num_computed, state.blend_end)
        state.fall_back("external_trimmed", stats)
    end = min(num_computed, state.blend_end)
    if plan.prefix_tokens >= end:
        return None, []
    state.blended = True
    tokens = state.request.prompt_token_ids
    region = BlendRegion(plan.prefix_tokens, list(tokens[plan.prefix_tokens:end]), state.ratio, state.selection,
                         state.prompt_len, sorted({b.chunk_start for b in plan.loaded}), state.chunk_start_tokens,
                         state.kv_shift, state.kv_shift_sample)
    loaded = [b for b in plan.loaded if b.placed.start < end]
    if not state.preemptions:
        stats.add("blended_requests")
        stats.add("chunk_hit_tokens", sum(len(b.placed) for b in loaded))
    return region, chunk_loads(loaded, state.keys, view)


def chunk_prefetch(state: RequestState, view: StoreView) -> ChunkPrefetch:
    """The chunk blocks a blend request's step will read, to be read while it waits in the queue."""
    loads = chunk_loads([b for b in state.plan.loaded if b.placed.start < state.blend_end], state.keys, view,
                        count=False)
    unique = {ld.key: ld.stored_rows for ld in loads}
    return ChunkPrefetch(state.request.request_id, list(unique), list(unique.values()))
