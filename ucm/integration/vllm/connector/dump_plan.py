"""Which of a request's blocks are stored after a step: exact prefix blocks, chunk blocks (as KV
or as references into the exact blocks that hold their rows), each once, each only when the
request is trusted and its segment admitted (admission.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ucm.integration.vllm.connector.metadata import BlockDump
from ucm.integration.vllm.connector.request_state import RequestState
from ucm.integration.vllm.connector.store_view import StoreView, WaitingRef
from ucm.sparse.blend.chunk_refs import encode_ref, make_ref
from ucm.sparse.blend.chunking import Span
from ucm.store.keys import KeyKind

if TYPE_CHECKING:
    from ucm.config import BlendConfig


def new_dumps(state: RequestState, computed_end: int, hashes: list[bytes], view: StoreView,
              blend: BlendConfig | None) -> list[BlockDump]:
    """Blocks whose KV is complete once `computed_end` prompt tokens are computed and not yet
    stored; chunk blocks stored as references are queued on `view` (written once their exact
    blocks are confirmed). `hashes` are the request's exact-prefix hashes (unsalted)."""
    bs, keys = view.block_size, state.keys
    dumps: list[BlockDump] = []
    end = min(computed_end, state.exact_limit, state.prompt_len)
    for b in range(end // bs):
        if b in state.dumped_blocks or b >= len(state.exact_stored):
            continue
        state.dumped_blocks.add(b)
        if state.exact_stored[b]:
            continue
        if state.admission and not state.admission.admits(Span(b * bs, (b + 1) * bs)):
            view.stats.add("blocks_not_admitted")
            continue
        dumps.append(BlockDump(keys.key(KeyKind.EXACT, hashes[b]), b * bs, bs))
    plan = state.plan
    if plan is None:
        return dumps
    # Exact blocks hold the prompt's KV up to `covered` now and up to `coverable` once computed.
    coverable = min(state.exact_limit, state.prompt_len) // bs * bs
    covered = end // bs * bs
    for i, blk in enumerate(plan.blocks):
        if blk.hit or i in state.dumped_chunk_blocks or blk.tokens.end > min(computed_end, state.prompt_len):
            continue
        exact = blk.chunk_start == 0 and blk.tokens.end <= state.exact_limit
        as_ref = not exact and blend.chunk_refs and blk.tokens.end <= coverable
        if as_ref and blk.tokens.end > covered:
            continue  # its exact blocks are complete after a later step
        state.dumped_chunk_blocks.add(i)
        if exact and len(blk.tokens) == bs:
            continue  # a full exact block at the prompt start is the prefix dump above
        if not exact and blend.chunk_store == "alone":
            continue  # computed after other text: that text must not shape what others reuse
        if state.admission and not state.admission.admits(blk.tokens):
            continue  # first sighting of its chunk (its exact blocks are counted above)
        ref = make_ref(blk.tokens, hashes[:state.prompt_len // bs], bs) if as_ref else None
        if ref is not None:  # its KV is in the exact blocks dumped above: stored once, found through a reference
            view.refs_waiting.append(WaitingRef(
                state.request.request_id, keys.key(KeyKind.CHUNK_REF, blk.block_hash), encode_ref(ref),
                frozenset(keys.key(KeyKind.EXACT, h) for h in ref.sources), time.monotonic()))
            continue
        kind = KeyKind.EXACT if exact else KeyKind.CHUNK
        dumps.append(BlockDump(keys.key(kind, blk.block_hash), blk.tokens.start, len(blk.tokens), blk.chunk_start))
    return dumps
