"""The lookup plan and the Blend region handed to the engine as computed (ucm.sparse.blend.plan)."""

from __future__ import annotations

import random

import pytest

from ucm.sparse.blend.chunk_refs import ChunkRef
from ucm.sparse.blend.chunking import split_by_lengths
from ucm.sparse.blend.hashing import BlockHasher
from ucm.sparse.blend.plan import blend_region_end, bounded_region_end, build_plan, region_hit_share, region_work
from ucm.store.keys import KeyKind

BS = 4


def plan_for(lengths, prompt_len, stored_chunk_blocks, prefix_tokens=0):
    """A plan over chunks of `lengths` (then a suffix), where the chunk blocks numbered in
    `stored_chunk_blocks` (in prompt order) are in the store as CHUNK KV."""
    hasher = BlockHasher.from_seed("sha256", BS, "test")
    tokens = list(range(1000, 1000 + prompt_len))
    layout = split_by_lengths(prompt_len, lengths)
    hashes = []
    plan0 = build_plan(layout, tokens, hasher, 0, lambda kind, hs: [False] * len(hs))
    for i, blk in enumerate(plan0.blocks):
        if i in stored_chunk_blocks:
            hashes.append(blk.block_hash)
    stored = set(hashes)
    return build_plan(layout, tokens, hasher, prefix_tokens,
                      lambda kind, hs: [kind is KeyKind.CHUNK and h in stored for h in hs])


def test_region_holds_the_question_up_to_the_last_token():
    # chunks [0, 6) [6, 16) then a question [16, 20); chunk blocks: [0,4) [4,6) [6,10) [10,14) [14,16)
    plan = plan_for([6, 10], 20, {0, 1, 2, 3})
    assert [len(b.placed) for b in plan.loaded] == [4, 2, 4, 4]
    # The engine schedules only the last token: a budget cannot split the question off the blend.
    assert blend_region_end(plan, 20) == 19
    # 14 loaded tokens, 15% recomputed (rounded up), and the 5 tokens without KV: [14, 16), [16, 19).
    assert region_work(plan, 19, 0.15) == 5 + 3
    assert region_work(plan, 19, 1.0) == 19 and region_work(plan, 19, 0.0) == 5


def test_misses_inside_the_region_are_its_work():
    plan = plan_for([6, 10], 20, {0, 2, 4})  # loaded [0,4), [6,10) and [14,16); [4,6) and [10,14) missed
    assert blend_region_end(plan, 20) == 19
    assert region_work(plan, 19, 0.0) == 9  # the 6 missed tokens and the question run every layer
    assert region_work(plan, 19, 0.5) == 9 + 5  # ceil(0.5 * 10)


def test_chunk_hits_count_each_chunks_blocks_and_hits():
    plan = plan_for([6, 10], 20, {0, 2, 4})  # chunk 0: [0,4) hit, [4,6) missed; chunk 6: its middle block missed
    assert plan.chunk_hits() == [(0, 2, 1), (6, 3, 2)]
    # A chunk whose first block is missing is taken as missing whole: [14,16) is not looked up.
    assert plan_for([6, 10], 20, {0, 4}).chunk_hits() == [(0, 2, 1), (6, 3, 0)]
    # Blocks in the exact prefix are not looked up: chunk 0 then has one block, missed.
    assert plan_for([6, 10], 20, {2, 3}, prefix_tokens=4).chunk_hits() == [(0, 1, 0), (6, 3, 2)]


def test_the_engine_keeps_at_least_the_last_token():
    plan = plan_for([6, 10], 16, {0, 1, 2, 3, 4})  # no suffix: the prompt ends inside the last chunk
    assert blend_region_end(plan, 16) == 15
    assert region_work(plan, 15, 0.0) == 0


def test_nothing_loaded_is_an_empty_region_at_the_prefix():
    plan = plan_for([6, 10], 20, set(), prefix_tokens=4)
    assert plan.loaded == () and blend_region_end(plan, 20) == 4
    plan = plan_for([6, 10], 20, {0, 2}, prefix_tokens=4)  # block 0 lies in the exact prefix
    assert [b.placed.start for b in plan.loaded] == [6]
    assert blend_region_end(plan, 20) == 19 and region_work(plan, 19, 0.0) == 11  # [4, 6) and [10, 19)


def recording(answer):
    """A `lookup_many` answering with ``answer(kind, hash)`` that records each round's (kind, count)
    pairs, and the `lookup` of the same answers."""
    rounds = []

    def lookup_many(asks):
        rounds.append([(kind, len(hs)) for kind, hs in asks])
        return [[answer(kind, h) for h in hs] for kind, hs in asks]

    return rounds, lookup_many, lambda kind, hs: [answer(kind, h) for h in hs]


def test_new_chunks_cost_one_round_not_one_per_kind():
    """The first block of each chunk is asked for in every kind in one round; the blocks of
    chunks found are then asked for in the kind their first block was found in, in a second."""
    hasher = BlockHasher.from_seed("sha256", BS, "test")
    tokens = list(range(1000, 1040))
    layout = split_by_lengths(40, [12, 12, 12])
    stored = {b.block_hash for b in build_plan(layout, tokens, hasher, 0, lambda kind, hs: [False] * len(hs)).blocks
              if b.chunk_start == 12}
    rounds, lookup_many, lookup = recording(lambda kind, h: kind is KeyKind.CHUNK and h in stored)
    no_refs = lambda blocks: [None] * len(blocks)  # noqa: E731
    plan = build_plan(layout, tokens, hasher, 0, lookup, lookup_refs=no_refs, lookup_many=lookup_many)
    assert plan.chunk_hits() == [(0, 3, 0), (12, 3, 3), (24, 3, 0)]
    assert rounds == [[(KeyKind.EXACT, 3), (KeyKind.CHUNK, 3), (KeyKind.CHUNK_REF, 3)], [(KeyKind.CHUNK, 3)]]
    # Without a batched lookup each (kind, hashes) pair is asked alone, with the same plan.
    assert build_plan(layout, tokens, hasher, 0, lookup, lookup_refs=no_refs) == plan


PROBE = [(KeyKind.EXACT, 1), (KeyKind.CHUNK, 1), (KeyKind.CHUNK_REF, 1)]
AS_KV = [(KeyKind.EXACT, 1), (KeyKind.CHUNK, 1)]


@pytest.mark.parametrize("as_refs, as_copies, kinds, rounds", [
    # The usual reference chunk: its last block (past the other prompt's last full block) a copy,
    # found in the round that asks for it as KV.
    ({0, 1, 2}, {3}, [KeyKind.CHUNK_REF] * 3 + [KeyKind.CHUNK], [PROBE, AS_KV, ("refs", 4)]),
    # A copy before the last block: asked for as KV in a third round; a block stored in none stays a miss.
    ({0, 1}, {2}, [KeyKind.CHUNK_REF] * 2 + [KeyKind.CHUNK, None], [PROBE, AS_KV, ("refs", 4), AS_KV]),
    # The last block stored both ways is read through its reference, as the chunk's other blocks are.
    ({0, 1, 2, 3}, {3}, [KeyKind.CHUNK_REF] * 4, [PROBE, AS_KV, ("refs", 4)]),
])
def test_a_chunk_stored_partly_as_references_finds_its_copies_in_the_other_kinds(as_refs, as_copies, kinds, rounds):
    """A chunk's head stored as references into another prompt's exact blocks, its tail as a copy
    (past that prompt's last full block): references first, the blocks they miss in the other
    kinds (exact KV first), in as few rounds as that takes."""
    hasher = BlockHasher.from_seed("sha256", BS, "test")
    tokens = list(range(1000, 1016))
    layout = split_by_lengths(16, [16])
    h = [b.block_hash for b in build_plan(layout, tokens, hasher, 0, lambda kind, hs: [False] * len(hs)).blocks]
    refs = {h[i] for i in as_refs}
    asked, lookup_many, lookup = recording(
        lambda kind, x: (kind is KeyKind.CHUNK_REF and x in refs) or (kind is KeyKind.CHUNK and h.index(x) in as_copies))

    def lookup_refs(blocks):
        asked.append(("refs", len(blocks)))
        return [ChunkRef(0, n, BS, (bh,)) if bh in refs else None for bh, n in blocks]

    plan = build_plan(layout, tokens, hasher, 0, lookup, lookup_refs=lookup_refs, lookup_many=lookup_many)
    assert [b.kind for b in plan.blocks] == kinds
    assert asked == rounds
    assert build_plan(layout, tokens, hasher, 0, lookup, lookup_refs=lookup_refs) == plan


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_work_never_exceeds_the_region(ratio):
    plan = plan_for([6, 10], 20, {1, 3})
    end = blend_region_end(plan, 20)
    assert 0 <= region_work(plan, end, ratio) <= end - plan.prefix_tokens


def test_hit_share_is_the_loaded_part_of_the_region():
    plan = plan_for([6, 10], 20, {0, 2})  # loaded [0,4) and [6,10) of the region [0, 19)
    assert region_hit_share(plan, 19) == pytest.approx(8 / 19)
    assert region_hit_share(plan, 0) == 0.0


@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5, 1.0])
@pytest.mark.parametrize("max_rows", [0, 1, 3, 5, 8, 100])
def test_a_bounded_region_fits_its_cap_and_never_cuts_a_loaded_block(ratio, max_rows):
    plan = plan_for([6, 10], 20, {0, 1, 3, 4})  # loaded [0,4) [4,6) [10,14) [14,16); [6,10) missed
    end = blend_region_end(plan, 20)
    cut = bounded_region_end(plan, end, ratio, max_rows, max_staged=100)
    assert plan.prefix_tokens <= cut <= end
    assert region_work(plan, cut, ratio) <= max_rows
    assert not any(b.placed.start < cut < b.placed.end for b in plan.loaded)
    if region_work(plan, end, ratio) <= max_rows:
        assert cut == end  # fits: not cut
    else:  # the longest that fits, up to the start of the block it would cut
        assert region_work(plan, cut + 1, ratio) > max_rows or any(b.placed.start == cut for b in plan.loaded)


def test_a_bounded_region_stages_at_most_its_share_of_loaded_tokens():
    plan = plan_for([6, 10], 20, {0, 1, 2, 3, 4})  # everything loaded but the question
    assert bounded_region_end(plan, 19, 0.0, max_rows=100, max_staged=10) == 10  # [0,4) [4,6) [6,10)


@pytest.mark.parametrize("seed", range(40))
def test_each_block_is_found_in_its_chunks_kind_then_exact_chunk_references(seed):
    """Random stores: a chunk whose first block is stored in no kind is a miss whole; a block of
    a chunk found is read from the kind its chunk's first block was found in when it is there,
    else from exact KV, chunk KV, a reference, in that order (batched or one lookup at a time)."""
    rng = random.Random(seed)
    hasher = BlockHasher.from_seed("sha256", BS, "test")
    tokens = [rng.randrange(1000, 2000) for _ in range(60)]
    layout = split_by_lengths(60, [13, 8, 20, 19])
    prefix = rng.choice([0, 0, 4, 9])
    blocks = build_plan(layout, tokens, hasher, prefix, lambda kind, hs: [False] * len(hs)).blocks
    kinds = (KeyKind.EXACT, KeyKind.CHUNK, KeyKind.CHUNK_REF)
    held = {(k, b.block_hash) for b in blocks for k in kinds if rng.random() < 0.4}
    valid = {b.block_hash for b in blocks if rng.random() < 0.7}  # references whose exact blocks are stored
    answer = lambda kind, h: (kind, h) in held  # noqa: E731
    refs = lambda bs: [ChunkRef(0, n, BS, (h,)) if (KeyKind.CHUNK_REF, h) in held and h in valid else None  # noqa: E731
                       for h, n in bs]
    _, lookup_many, lookup = recording(answer)
    plan = build_plan(layout, tokens, hasher, prefix, lookup, lookup_refs=refs, lookup_many=lookup_many)
    assert build_plan(layout, tokens, hasher, prefix, lookup, lookup_refs=refs) == plan

    def usable(kind, h):
        return (kind, h) in held and (kind is not KeyKind.CHUNK_REF or h in valid)

    firsts = {}
    for b in blocks:
        firsts.setdefault(b.chunk_start, b.block_hash)
    for b in plan.blocks:
        probed = next((k for k in kinds if (k, firsts[b.chunk_start]) in held), None)
        if probed is None:
            assert b.kind is None
            continue
        order = [probed] + [k for k in kinds if k is not probed]
        assert b.kind == next((k for k in order if usable(k, b.block_hash)), None)
