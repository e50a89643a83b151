"""Chunk references: a chunk block found in another prompt's exact blocks, row by row."""

from __future__ import annotations

import pytest

from ucm.sparse.blend.chunk_refs import (REF_BYTES, ChunkRef, covering_blocks, decode_ref, encode_ref, make_ref,
                                         ref_pieces)
from ucm.sparse.blend.chunking import Span

BS = 4
HASHES = [bytes([i]) * 32 for i in range(6)]  # exact blocks [0, 4) [4, 8) ... [20, 24)


def test_a_chunk_block_is_covered_by_the_exact_blocks_of_its_rows():
    assert covering_blocks(13, 4, BS) == range(3, 5)  # rows 13..16: blocks [12, 16) and [16, 20)
    assert covering_blocks(12, 4, BS) == range(3, 4)  # aligned
    assert make_ref(Span(13, 17), HASHES, BS) == ChunkRef(13, 4, BS, (HASHES[3], HASHES[4]))
    assert make_ref(Span(22, 25), HASHES, BS) is None  # token 24 has no exact block
    assert make_ref(Span(5, 5), HASHES, BS) is None


def test_a_reference_reads_back_as_written_and_anything_else_is_a_miss():
    ref = make_ref(Span(13, 17), HASHES, BS)
    record = encode_ref(ref)
    assert len(record) == REF_BYTES
    assert decode_ref(record, 4, BS) == ref
    assert decode_ref(record, 3, BS) is None  # another block length: not this block's reference
    assert decode_ref(record, 4, 8) is None  # another block size
    assert decode_ref(bytes(REF_BYTES), 4, BS) is None
    assert decode_ref(b"\xff" * REF_BYTES, 4, BS) is None
    other_format = bytearray(record)
    other_format[1] = 0x7F  # the format number, first in the record
    assert decode_ref(bytes(other_format), 4, BS) is None
    truncated = record[:40] + bytes(REF_BYTES - 40)  # a source hash cut short
    assert decode_ref(truncated, 4, BS) is None


def test_rows_go_to_the_new_positions_rotated_by_the_move():
    ref = ChunkRef(13, 4, BS, (HASHES[3], HASHES[4]))
    # The block's tokens now start at 6: rows 1..3 of block 3 go to 6..8, row 0 of block 4 to 9.
    pieces = ref_pieces(ref, Span(6, 10), block_start=6)
    assert [(p.source, p.rows, p.start, p.rope_delta) for p in pieces] == [
        (HASHES[3], Span(1, 4), 6, -7), (HASHES[4], Span(0, 1), 9, -7)]
    # Its first two tokens are covered by the exact prefix: only rows for positions 8, 9.
    pieces = ref_pieces(ref, Span(8, 10), block_start=6)
    assert [(p.source, p.rows, p.start) for p in pieces] == [(HASHES[3], Span(3, 4), 8), (HASHES[4], Span(0, 1), 9)]
    assert ref_pieces(ref, Span(10, 10), block_start=6) == []


@pytest.mark.parametrize("position,length,start", [(0, 4, 20), (5, 3, 0), (7, 4, 30), (8, 2, 8)])
def test_the_pieces_cover_every_placed_row_once(position, length, start):
    ref = make_ref(Span(position, position + length), HASHES, BS)
    pieces = ref_pieces(ref, Span(start, start + length), block_start=start)
    rows = [(HASHES.index(p.source) * BS + r) for p in pieces for r in range(p.rows.start, p.rows.end)]
    placed = [p.start + i for p in pieces for i in range(len(p.rows))]
    assert rows == list(range(position, position + length))
    assert placed == list(range(start, start + length))
    assert all(p.rope_delta == start - position for p in pieces)
