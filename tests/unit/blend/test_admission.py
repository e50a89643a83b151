"""The second-sighting admission rule: which parts of a prompt are stored, named by what."""

import pytest

from ucm.sparse.blend.admission import (Admission, RecentHits, Segment, admits_first_sighting, asks_nothing,
                                        prompt_segments, reused_unstored)
from ucm.sparse.blend.chunking import Span, split_by_marker
from ucm.sparse.blend.plan import ChunkBlock

BS, MARKER = 4, 2


def test_segments_are_the_chunks_and_the_suffix_up_to_the_last_full_block():
    tokens = [5, 6, MARKER, 7, 8, 9, 10, MARKER, 11, 12, 13, 14, 15]  # chunks [0,3) [3,8), suffix [8,13)
    layout = split_by_marker(tokens, MARKER)
    prefix = [b"p0", b"p1", b"p2"]  # 3 full blocks: 12 tokens
    segs = prompt_segments(layout, [b"c0", b"c1"], prefix, BS)
    assert segs == [Segment(Span(0, 3), b"c0"), Segment(Span(3, 8), b"c1"), Segment(Span(8, 12), b"p2")]
    # The suffix has no full block of its own after the chunks: no segment for it.
    assert prompt_segments(layout, [b"c0", b"c1"], prefix[:2], BS)[-1] == Segment(Span(3, 8), b"c1")
    # No layout: the prompt's full blocks are one segment, named by the last of them.
    assert prompt_segments(None, [], prefix, BS) == [Segment(Span(0, 12), b"p2")]
    assert prompt_segments(None, [], [], BS) == []
    with pytest.raises(ValueError, match="1 chunk hashes for 2 chunks"):
        prompt_segments(layout, [b"c0"], prefix, BS)


def test_a_block_is_admitted_when_it_overlaps_a_segment_seen_before():
    segs = (Segment(Span(0, 3), b"c0"), Segment(Span(3, 8), b"c1"), Segment(Span(8, 12), b"p2"))
    admission = Admission(segs, (True, False, False))
    assert admission.admits(Span(0, 4))  # across the boundary of a seen chunk and an unseen one
    assert not admission.admits(Span(4, 8)) and not admission.admits(Span(8, 12))
    assert admission.first_sightings() == [b"c1", b"p2"] and not all(admission.seen)
    repeated = Admission((segs[0], Segment(Span(3, 8), b"c0")), (False, False))  # the same chunk twice
    assert repeated.first_sightings() == [b"c0"]
    with pytest.raises(ValueError):
        Admission(segs, (True,))


def test_a_prompt_ending_with_a_chunk_asks_nothing():
    assert asks_nothing(split_by_marker([5, 6, MARKER, 7, MARKER], MARKER))
    assert not asks_nothing(split_by_marker([5, 6, MARKER, 7], MARKER))
    assert not asks_nothing(split_by_marker([5, 6, 7], MARKER))  # no chunk at all
    assert not asks_nothing(None)


def test_adaptive_admits_first_sightings_while_recent_lookups_hit():
    recent = RecentHits(size=3, evidence=2)
    assert recent.share() is None and admits_first_sighting("adaptive", recent)  # no evidence yet: reuse assumed
    assert admits_first_sighting("first_sighting", recent) and not admits_first_sighting("second_sighting", recent)
    recent.add(0, 40)
    recent.add(0, 0)  # nothing looked up: not counted
    assert recent.share() is None
    recent.add(5, 10)
    assert recent.share() == 5 / 50 and admits_first_sighting("adaptive", recent)  # ADMIT_ALL_HIT_SHARE
    recent.add(0, 10)
    assert recent.share() == 5 / 60 and not admits_first_sighting("adaptive", recent)
    recent.add(0, 10)  # the 0 of 40 left the window
    assert recent.share() == 5 / 30 and admits_first_sighting("adaptive", recent)
    assert not admits_first_sighting("second_sighting", recent)


def test_a_cold_lookup_counts_only_when_what_it_found_shows_reuse():
    recent = RecentHits(size=4, evidence=2)
    recent.add(0, 40, warm=False)  # planned before any request finished: could not have found anything
    recent.add(1, 40, warm=False)  # the block every prompt shares: no evidence either way
    assert recent.share() is None
    recent.add(8, 40, warm=False)  # found a share of it (another instance's KV): evidence
    recent.add(0, 40)
    assert recent.share() == 8 / 80


def test_blocks_of_a_chunk_sighted_before_count_as_reuse():
    segs = (Segment(Span(0, 8), b"c0"), Segment(Span(8, 16), b"c1"), Segment(Span(16, 20), b"p4"))
    missed = [ChunkBlock(b"h%d" % i, start, Span(i * BS, (i + 1) * BS), None) for i, start in
              [(0, 0), (1, 0), (2, 8), (3, 8)]]
    assert reused_unstored(missed, Admission(segs, (False, True, False))) == 2  # c1's two blocks
    assert reused_unstored(missed, Admission(segs, (False, False, True))) == 0  # the suffix holds no chunk block
    assert reused_unstored(missed, None) == 0  # first-sighting mode: only stored KV was looked up
