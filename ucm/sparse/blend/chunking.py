"""Split a CacheBlend prompt into reusable text chunks and a suffix.

A blended prompt is ``chunk_0 .. chunk_{n-1} suffix``. Each chunk's KV is stored
(and looked up) independently of what precedes it, so the layout must be derived
identically when the chunk is first stored and when it is later reused: either
from an end-of-chunk marker token that belongs to the chunk it ends, or from
per-request chunk lengths. The suffix (typically the question) is never reused
and is always recomputed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Span", "ChunkLayout", "split_by_marker", "split_by_lengths"]


@dataclass(frozen=True)
class Span:
    """Half-open token range ``[start, end)`` inside one prompt."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid span [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkLayout:
    """Chunks (in prompt order, gap-free from token 0) followed by the suffix."""

    chunks: tuple[Span, ...]
    suffix: Span

    def __post_init__(self) -> None:
        # Reuse relies on chunks tiling the prompt: a gap would be a token whose
        # KV belongs to no chunk and whose position no delta accounts for.
        expected = 0
        for span in (*self.chunks, self.suffix):
            if span.start != expected:
                raise ValueError(f"spans must be contiguous from 0; got {self}")
            expected = span.end

    @property
    def num_tokens(self) -> int:
        """Prompt length (chunks plus suffix)."""
        return self.suffix.end

    @property
    def num_chunk_tokens(self) -> int:
        """Tokens covered by chunks, i.e. the start of the suffix."""
        return self.suffix.start

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        """Start position of each chunk: the delta-RoPE shift of its stored K."""
        return tuple(c.start for c in self.chunks)

    def chunk_tokens(self, token_ids: Sequence[int]) -> Iterator[Sequence[int]]:
        """Yield each chunk's token ids (the key material for its stored KV)."""
        for c in self.chunks:
            yield token_ids[c.start : c.end]


def split_by_marker(token_ids: Sequence[int], chunk_end_token_id: int) -> ChunkLayout:
    """Chunks end at (and include) each ``chunk_end_token_id``; the rest is suffix.

    Consecutive markers give one-token chunks, a trailing marker gives an empty
    suffix and a prompt without markers is all suffix (nothing to blend).
    """
    n = len(token_ids)
    if n == 0:
        return ChunkLayout((), Span(0, 0))
    ends = np.flatnonzero(np.asarray(token_ids) == chunk_end_token_id) + 1
    starts = np.concatenate(([0], ends[:-1]))
    chunks = tuple(Span(int(s), int(e)) for s, e in zip(starts, ends))
    last = int(ends[-1]) if len(ends) else 0
    return ChunkLayout(chunks, Span(last, n))


def split_by_separator(token_ids: Sequence[int], separator: Sequence[int]) -> ChunkLayout:
    """Chunks end at (and include) each occurrence of the token sequence ``separator`` (LMCache's
    special string, tokenized), found left to right without overlap; the rest is suffix. A
    one-token separator is ``split_by_marker``."""
    separator = tuple(int(t) for t in separator)
    if not separator:
        raise ValueError("separator must hold at least one token")
    if len(separator) == 1:
        return split_by_marker(token_ids, separator[0])
    tokens = np.asarray(token_ids)
    n, k = len(tokens), len(separator)
    if n < k:
        return ChunkLayout((), Span(0, n))
    # Candidate starts where every separator token matches, then a left-to-right pass drops overlaps.
    match = np.ones(n - k + 1, dtype=bool)
    for i, t in enumerate(separator):
        match &= tokens[i:n - k + 1 + i] == t
    ends, free = [], 0
    for start in np.flatnonzero(match).tolist():
        if start >= free:
            free = start + k
            ends.append(free)
    starts = [0, *ends[:-1]]
    return ChunkLayout(tuple(Span(s, e) for s, e in zip(starts, ends)), Span(ends[-1] if ends else 0, n))


def split_by_lengths(num_tokens: int, chunk_lengths: Sequence[int]) -> ChunkLayout:
    """Chunks of the given lengths from token 0; the remaining tokens are suffix.

    Used when the client states the boundaries per request instead of marking
    them in-band.
    """
    num_tokens = _as_int(num_tokens, "num_tokens")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    chunks: list[Span] = []
    start = 0
    for i, length in enumerate(chunk_lengths):
        length = _as_int(length, f"chunk_lengths[{i}]")
        if length <= 0:
            raise ValueError(f"chunk_lengths[{i}] must be a positive int, got {length}")
        chunks.append(Span(start, start + length))
        start += length
    if start > num_tokens:
        raise ValueError(
            f"chunk lengths sum to {start}, more than the prompt's {num_tokens} tokens"
        )
    return ChunkLayout(tuple(chunks), Span(start, num_tokens))


def _as_int(value: object, name: str) -> int:
    # bool is an int subclass but a boolean length is surely a caller bug.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # accepts numpy ints, rejects floats
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
