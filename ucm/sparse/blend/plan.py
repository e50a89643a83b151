"""Lookup plan of one request: exact prefix first, then chunk blocks at any position.

The plan is engine-agnostic: it takes the chunk layout, the block hasher and a lookup function
and says which stored blocks to load where. Tokens before `prefix_tokens` are exact prefix hits
(vLLM's own cache or the store); every chunk block after that is looked up under its chunk hash
(in the kind its chunk's first block was found in, then the others), block by block, so a missing
block in the middle of a chunk costs only that block; a chunk whose first block is missing is not
looked up further.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ucm.sparse.blend.chunk_refs import ChunkRef
from ucm.sparse.blend.chunking import ChunkLayout, Span
from ucm.sparse.blend.hashing import BlockHash, BlockHasher, IsolationKeys
from ucm.store.keys import KeyKind

# (kind, block hashes) -> hit per hash (CHUNK_REF: a reference is present, not yet checked)
LookupFn = Callable[[KeyKind, Sequence[BlockHash]], list[bool]]
# (kind, block hashes) pairs answered in one round trip -> hits per pair
LookupManyFn = Callable[[Sequence[tuple[KeyKind, Sequence[BlockHash]]]], list[list[bool]]]
# (block hash, tokens) per chunk block -> its stored reference into exact blocks, or None
RefLookupFn = Callable[[Sequence[tuple[BlockHash, int]]], list[ChunkRef | None]]


@dataclass(frozen=True)
class ChunkBlock:
    """One stored block of a chunk, placed in the prompt.

    `tokens` is where the block's tokens sit in the prompt; the block's first token sits at
    chunk-local position `tokens.start - chunk_start`, so its K must be rotated by `chunk_start`.
    `skip` leading tokens are already covered by the exact prefix and are not written.
    A block found as a reference (kind CHUNK_REF) is read from the exact blocks `ref` names.
    """

    block_hash: BlockHash
    chunk_start: int
    tokens: Span
    kind: KeyKind | None  # where it was found; None: a miss, computed in this request
    skip: int = 0
    ref: ChunkRef | None = None

    @property
    def hit(self) -> bool:
        return self.kind is not None

    @property
    def placed(self) -> Span:
        return Span(self.tokens.start + self.skip, self.tokens.end)


@dataclass(frozen=True)
class BlendPlan:
    num_tokens: int
    prefix_tokens: int
    layout: ChunkLayout
    blocks: tuple[ChunkBlock, ...]
    # Per chunk of the layout, its last block's hash: names the chunk's text wherever it sits
    # (admission.py records sightings under it).
    chunk_last_hashes: tuple[BlockHash, ...] = ()

    @property
    def loaded(self) -> tuple[ChunkBlock, ...]:
        return tuple(b for b in self.blocks if b.hit and len(b.placed) > 0)

    @property
    def missed(self) -> tuple[ChunkBlock, ...]:
        return tuple(b for b in self.blocks if not b.hit)

    @property
    def first_approximate_token(self) -> int | None:
        """From here on the request's KV is approximate (loaded, or computed after loaded KV).

        Exact KV of a chunk that opens the prompt sits at its own positions: it is exact.
        """
        starts = [b.placed.start for b in self.loaded if not (b.kind is KeyKind.EXACT and b.chunk_start == 0)]
        return min(starts) if starts else None

    @property
    def num_loaded_tokens(self) -> int:
        return sum(len(b.placed) for b in self.loaded)

    def chunk_hits(self) -> list[tuple[int, int, int]]:
        """(chunk start, blocks looked up, blocks hit) per chunk, in prompt order: which chunks a
        request found, for its report (a benchmark replays a request with the same chunks missing)."""
        per: dict[int, list[int]] = {}
        for b in self.blocks:
            counts = per.setdefault(b.chunk_start, [0, 0])
            counts[0] += 1
            counts[1] += b.hit
        return [(start, n, hit) for start, (n, hit) in per.items()]


def chunk_blocks(layout: ChunkLayout, token_ids: Sequence[int], hasher: BlockHasher,
                 isolation: IsolationKeys | None = None) -> list[tuple[BlockHash, int, Span]]:
    """(hash, chunk start, prompt span) of every block of every chunk, partial tails included."""
    out = []
    bs = hasher.block_size
    for chunk in layout.chunks:
        hashes = hasher.chunk_hashes(token_ids[chunk.start:chunk.end], isolation)
        for i, h in enumerate(hashes):
            start = chunk.start + i * bs
            out.append((h, chunk.start, Span(start, min(start + bs, chunk.end))))
    return out


def build_plan(layout: ChunkLayout, token_ids: Sequence[int], hasher: BlockHasher, prefix_tokens: int,
               lookup: LookupFn, isolation: IsolationKeys | None = None,
               lookup_refs: RefLookupFn | None = None, lookup_many: LookupManyFn | None = None) -> BlendPlan:
    """Look up every chunk block that ends after the exact prefix: as exact KV, chunk KV, or a
    reference into another prompt's exact blocks (`lookup_refs`).

    Each chunk's first block is looked up first, in every kind at once (exact, chunk KV, and
    references by their presence): a chunk whose first block is stored in none is taken as
    missing whole. Chunks are stored from their first block on, so this loses almost nothing,
    and a prompt of new passages costs one round of lookups instead of several per block (each
    a round trip on NFS). The other blocks of a chunk found are looked up in the kind its first
    block was found in, all chunks in one round; those not there in the other kinds (exact KV
    first). One chunk may be stored partly as references into another prompt's exact blocks and
    partly as copies (its blocks past that prompt's last full block): the last block of a chunk
    found as references is asked as a copy in that same round. Most blocks thus cost one lookup,
    and a plan two or three rounds besides the references' own.

    ``lookup_many``: (kind, hashes) pairs answered in one round trip; without it ``lookup`` is
    asked once per pair. ``isolation``: the request's tenant and adapter keys; chunk KV is
    shared only under equal ones.
    """
    every = chunk_blocks(layout, token_ids, hasher, isolation)
    last = {c: h for h, c, _ in every}  # the last block of each chunk wins
    candidates = [(h, c, s) for h, c, s in every if s.end > prefix_tokens]
    ask = lookup_many or (lambda asks: [lookup(kind, hashes) for kind, hashes in asks])
    kinds = (KeyKind.EXACT, KeyKind.CHUNK) + ((KeyKind.CHUNK_REF,) if lookup_refs is not None else ())
    first_kind = _probed_chunks(candidates, ask, kinds)
    found: dict[BlockHash, KeyKind] = {}
    refs: dict[BlockHash, ChunkRef] = {}
    spans = {h: s for h, _, s in candidates}

    def find_kv(wanted: dict[KeyKind, list[BlockHash]]) -> dict[BlockHash, KeyKind]:
        """One round: each block in the kinds it is wanted in; the first kind (in `kinds`
        order) that holds it, per block not found before."""
        asks = [(kind, list(dict.fromkeys(h for h in wanted.get(kind, ()) if h not in found)))
                for kind in kinds if kind is not KeyKind.CHUNK_REF]
        asks = [(kind, hs) for kind, hs in asks if hs]
        held: dict[BlockHash, KeyKind] = {}
        for (kind, hs), hits in zip(asks, ask(asks) if asks else []):
            for h, hit in zip(hs, hits):
                if hit:
                    held.setdefault(h, kind)
        return held

    def find_refs(hashes: list[BlockHash]) -> None:
        blocks = list(dict.fromkeys(h for h in hashes if h not in found))
        if lookup_refs is None or not blocks:
            return
        for h, ref in zip(blocks, lookup_refs([(h, len(spans[h])) for h in blocks])):
            if ref is not None:
                found[h], refs[h] = KeyKind.CHUNK_REF, ref

    by_chunk: dict[KeyKind, list[BlockHash]] = {kind: [] for kind in kinds}  # blocks of the chunks found, by first kind
    chunk_lasts: dict[int, BlockHash] = {}
    for h, c, _ in candidates:
        if c in first_kind:
            by_chunk[first_kind[c]].append(h)
            chunk_lasts[c] = h
    # A list, not a set: the store is asked in prompt order, whatever the process's hash seed.
    ref_lasts = [h for c, h in chunk_lasts.items() if first_kind[c] is KeyKind.CHUNK_REF]
    # One round: the chunks' blocks in their first block's kind, and the last block of each chunk
    # found as references also as KV (where references end, copies may take over).
    wanted = {kind: list(by_chunk[kind]) for kind in kinds if kind is not KeyKind.CHUNK_REF}
    for kind in wanted:
        wanted[kind] += ref_lasts
    held = find_kv(wanted)
    found.update((h, kind) for h, kind in held.items() if h not in ref_lasts)
    find_refs(by_chunk.get(KeyKind.CHUNK_REF, []))  # references before copies
    found.update((h, held[h]) for h in ref_lasts if h not in found and h in held)
    # What is still missing of the chunks found, in the kinds not asked yet: KV in one round, then references.
    found.update(find_kv({kind: [h for other in kinds if other is not kind for h in by_chunk[other]
                                 if h not in found and not (h in ref_lasts and other is KeyKind.CHUNK_REF)]
                          for kind in kinds}))
    find_refs([h for kind in kinds if kind is not KeyKind.CHUNK_REF for h in by_chunk[kind] if h not in found])
    blocks = [ChunkBlock(h, chunk_start, span, found.get(h), skip=max(0, prefix_tokens - span.start), ref=refs.get(h))
              for h, chunk_start, span in candidates]
    return BlendPlan(len(token_ids), prefix_tokens, layout, tuple(blocks),
                     tuple(last[c.start] for c in layout.chunks))


def _probed_chunks(candidates: Sequence[tuple[BlockHash, int, Span]], ask: LookupManyFn,
                   kinds: Sequence[KeyKind]) -> dict[int, KeyKind]:
    """The kind each chunk's first candidate block is stored in (the first of `kinds` that has
    it; references by their presence), by chunk start, in one round; chunks stored in none are
    left out."""
    firsts: dict[int, BlockHash] = {}
    for h, c, _ in candidates:
        firsts.setdefault(c, h)
    if not firsts:
        return {}
    answers = ask([(kind, list(firsts.values())) for kind in kinds])
    found: dict[int, KeyKind] = {}
    for kind, hits in zip(kinds, answers):
        for c, hit in zip(firsts, hits):
            if hit:
                found.setdefault(c, kind)
    return found


def blend_region_end(plan: BlendPlan, prompt_len: int) -> int:
    """End of the region a request blends beside the rows the engine schedules.

    With any chunk KV loaded, the region runs from the exact prefix to the prompt's last token,
    which is left to the engine (it must compute one); the engine is told the region is computed
    (as it is told of prefix hits), so it schedules and charges one token. The question is thus
    part of the region, never split across steps by the engine's budget: the selection always
    sees all of it, whatever else shares the step. Returns ``plan.prefix_tokens`` (an empty
    region) when nothing is loaded.
    """
    if not plan.loaded:
        return plan.prefix_tokens
    return max(plan.prefix_tokens, prompt_len - 1)


def loaded_tokens(plan: BlendPlan, end: int) -> int:
    """Tokens before ``end`` whose KV is loaded from the store."""
    return sum(max(0, min(b.placed.end, end) - b.placed.start) for b in plan.loaded)


def region_hit_share(plan: BlendPlan, end: int) -> float:
    """Share of the region [plan.prefix_tokens, end) whose KV is loaded from the store (0 when empty)."""
    region = end - plan.prefix_tokens
    return loaded_tokens(plan, end) / region if region > 0 else 0.0


def bounded_region_end(plan: BlendPlan, end: int, ratio: float, max_rows: int, max_staged: int) -> int:
    """The largest region end <= ``end`` whose Blend work fits one step: at most ``max_rows`` rows
    run through the later layers (``region_work``) and at most ``max_staged`` loaded tokens staged.

    The tokens after it are left to the engine's own chunked prefill, so no request turns into one
    step of unbounded size. Both sizes only grow with the end, hence a bisection.
    """

    def fits(e: int) -> bool:
        return loaded_tokens(plan, e) <= max_staged and region_work(plan, e, ratio) <= max_rows

    if fits(end):
        return end
    lo, hi = plan.prefix_tokens, end  # fits(lo): an empty region
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    for b in plan.loaded:  # never cut through a loaded block: it is placed whole or not at all
        if b.placed.start < lo < b.placed.end:
            lo = b.placed.start
    return lo


def region_work(plan: BlendPlan, end: int, ratio: float) -> int:
    """Rows the Blend forward runs through the later layers for a region ending at ``end``: the
    tokens without loaded KV there (misses) and the recomputed share of the loaded ones."""
    loaded = loaded_tokens(plan, end)
    return end - plan.prefix_tokens - loaded + math.ceil(ratio * loaded)
