import numpy as np
import pytest

from ucm.sparse.blend.chunking import ChunkLayout, Span, split_by_lengths, split_by_marker, split_by_separator

M = 99  # marker token


def spans(layout: ChunkLayout) -> list[tuple[int, int]]:
    return [(c.start, c.end) for c in layout.chunks]


def test_span_len_and_validation():
    assert len(Span(3, 7)) == 4
    assert len(Span(5, 5)) == 0
    with pytest.raises(ValueError):
        Span(4, 3)
    with pytest.raises(ValueError):
        Span(-1, 3)


def test_marker_belongs_to_the_chunk_it_ends():
    toks = [1, 2, M, 3, M, 4, 5]
    lay = split_by_marker(toks, M)
    assert spans(lay) == [(0, 3), (3, 5)]
    assert lay.suffix == Span(5, 7)
    assert [list(t) for t in lay.chunk_tokens(toks)] == [[1, 2, M], [3, M]]
    assert lay.num_chunk_tokens == 5
    assert lay.num_tokens == 7
    assert lay.num_chunks == 2
    assert lay.chunk_offsets == (0, 3)


def test_consecutive_markers_give_one_token_chunks():
    lay = split_by_marker([M, M, 1, M, M], M)
    assert spans(lay) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert lay.suffix == Span(5, 5)  # trailing marker -> empty suffix
    assert len(lay.suffix) == 0


def test_no_marker_is_all_suffix():
    lay = split_by_marker([1, 2, 3], M)
    assert lay.chunks == ()
    assert lay.suffix == Span(0, 3)
    assert lay.num_chunk_tokens == 0


def test_empty_prompt_and_array_input():
    lay = split_by_marker([], M)
    assert lay.chunks == () and lay.suffix == Span(0, 0)
    lay = split_by_marker(np.array([5, M, 6]), M)
    assert spans(lay) == [(0, 2)] and lay.suffix == Span(2, 3)


def test_split_by_lengths():
    lay = split_by_lengths(10, [3, 4])
    assert spans(lay) == [(0, 3), (3, 7)]
    assert lay.suffix == Span(7, 10)
    lay = split_by_lengths(7, [3, 4])
    assert lay.suffix == Span(7, 7)
    lay = split_by_lengths(5, [])
    assert lay.chunks == () and lay.suffix == Span(0, 5)
    lay = split_by_lengths(5, [np.int64(2)])
    assert spans(lay) == [(0, 2)]


@pytest.mark.parametrize(
    "num_tokens, lengths, match",
    [
        (10, [3, 0], "positive"),
        (10, [3, -1], "positive"),
        (10, [2.5], "int"),
        (10, [True], "int"),
        (10, [6, 5], "sum"),
        (-1, [], ">= 0"),
    ],
)
def test_split_by_lengths_rejects(num_tokens, lengths, match):
    with pytest.raises(ValueError, match=match):
        split_by_lengths(num_tokens, lengths)


def test_layout_must_tile_the_prompt():
    with pytest.raises(ValueError):
        ChunkLayout((Span(0, 2), Span(3, 4)), Span(4, 5))
    with pytest.raises(ValueError):
        ChunkLayout((Span(0, 2),), Span(3, 5))


def test_split_by_separator_ends_chunks_with_each_occurrence():
    sep = (9, 8)
    layout = split_by_separator([1, 2, 9, 8, 3, 9, 9, 8, 4, 5], sep)
    assert [(c.start, c.end) for c in layout.chunks] == [(0, 4), (4, 8)]  # the separator ends its chunk
    assert (layout.suffix.start, layout.suffix.end) == (8, 10)
    # Overlapping occurrences are taken left to right; a prompt without one is all suffix.
    assert [(c.start, c.end) for c in split_by_separator([7, 7, 7, 1], (7, 7)).chunks] == [(0, 2)]
    assert split_by_separator([1, 2, 3], sep).chunks == ()
    assert split_by_separator([9], sep).chunks == ()
    # One token: the marker split.
    assert split_by_separator([1, 2, 5, 3], [5]) == split_by_marker([1, 2, 5, 3], 5)
    with pytest.raises(ValueError):
        split_by_separator([1, 2], [])
