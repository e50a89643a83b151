"""Which computed blocks a request stores: all of them, or those whose text was seen before.

Storing a block pays off only when a later request loads it. Where documents repeat, storing
every computed block is what makes the second request fast; where they do not, it writes the
prompt's whole KV (tens of KB per token) for nothing, on IO threads that share the cores with
the model. Under the second-sighting rule (a second-hit admission filter) a prompt is cut into
segments (each chunk, then the suffix) and a segment's KV is stored only when the store already
holds the segment's *sighting*: a record of a few bytes that the first request to compute it
writes instead of its KV. Sightings live in the shared store, so one instance's first sighting
admits the next instance's second.

A prompt with nothing after its last chunk asks nothing: it is an indexing request (or a chunk
computed alone in the background) and stores everything on first sighting.

The adaptive rule stores on first sighting while the engine's recent requests find much of what
they look for (a stream that repeats: a second sighting would only delay the first hit) and
falls back to the second sighting when they do not. What they find counts whether it was stored
as KV or only sighted: a repeat is evidence of reuse either way, so a stream that starts to
repeat while in second-sighting mode goes back to first sightings at once. A lookup is evidence
only when it could have found something: a request planned before any request of this engine has
finished finds little on an empty store whatever the traffic (the concurrent requests of a cold
start), so it counts only if it found enough to show reuse. Until the evidence is in, the engine assumes the
reuse it was configured for and stores the KV it computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ucm.sparse.blend.chunking import ChunkLayout, Span
from ucm.sparse.blend.hashing import BlockHash
from ucm.sparse.blend.plan import ChunkBlock

FIRST_SIGHTING = "first_sighting"  # every computed block is stored (no admission filter)
SECOND_SIGHTING = "second_sighting"
ADAPTIVE = "adaptive"  # first sighting while recent chunk lookups hit, else second
ADMISSION_POLICIES = (ADAPTIVE, FIRST_SIGHTING, SECOND_SIGHTING)
# Under ADAPTIVE: the share of chunk blocks found over the recent requests from which a first
# sighting is stored. A prompt's own system message hits on every request: a small share.
ADMIT_ALL_HIT_SHARE = 0.1
RECENT_REQUESTS = 16  # the window of that share
# Lookups that count (RecentHits.add) in the window before the share is trusted (before: first sightings
# stored). Chosen over many streams, not one (benchmarks/admission_sim.py; docs/research.md, "Admission's
# evidence, replayed").
EVIDENCE_REQUESTS = 2
# What a sighting record holds: its format, so that a record is never mistaken for KV or a reference.
SIGHTING_RECORD = b"ucm-sighting-v1\0"


@dataclass(frozen=True)
class Segment:
    """A part of the prompt admitted as a whole, and the hash its sighting is recorded under."""

    span: Span
    fingerprint: BlockHash


def prompt_segments(layout: ChunkLayout | None, chunk_last_hashes: Sequence[BlockHash],
                    prefix_hashes: Sequence[BlockHash], block_size: int) -> list[Segment]:
    """The segments of a prompt of ``layout.num_tokens`` tokens (or, with no layout, of
    ``len(prefix_hashes)`` full blocks and whatever follows them).

    A chunk is named by its last block's chunk hash (its text and the request's tenant and
    adapter, wherever it sits); the suffix by the prompt's last full exact block hash (the
    whole prompt up to there), so it is admitted only when the same prompt comes again. A
    prompt without a layout is one segment named the same way. Tokens after the last full
    block are never stored and belong to no segment of their own.
    """
    num_full = len(prefix_hashes)
    whole = prefix_hashes[-1] if num_full else None
    if layout is None:
        return [Segment(Span(0, num_full * block_size), whole)] if whole is not None else []
    if len(chunk_last_hashes) != layout.num_chunks:
        raise ValueError(f"{len(chunk_last_hashes)} chunk hashes for {layout.num_chunks} chunks")
    out = [Segment(span, h) for span, h in zip(layout.chunks, chunk_last_hashes)]
    if whole is not None and layout.suffix.start < num_full * block_size:
        out.append(Segment(Span(layout.suffix.start, num_full * block_size), whole))
    return out


def asks_nothing(layout: ChunkLayout | None) -> bool:
    """Whether the prompt ends with a chunk (an indexing request): stored on first sighting."""
    return layout is not None and layout.num_chunks > 0 and len(layout.suffix) == 0


@dataclass(frozen=True)
class Admission:
    """Which segments of one request were seen before (their KV is stored) and which were not
    (only their sighting is recorded)."""

    segments: tuple[Segment, ...]
    seen: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.segments) != len(self.seen):
            raise ValueError(f"{len(self.seen)} sightings for {len(self.segments)} segments")

    def admits(self, tokens: Span) -> bool:
        """Whether KV of these prompt tokens is stored: they overlap a segment seen before (an
        exact block across a boundary is stored when either side is admitted: a stored chunk's
        reference may point into it)."""
        return any(seen and s.span.start < tokens.end and tokens.start < s.span.end
                   for s, seen in zip(self.segments, self.seen))

    def first_sightings(self) -> list[BlockHash]:
        """Fingerprints to record: the segments not seen before (each once)."""
        return list(dict.fromkeys(s.fingerprint for s, seen in zip(self.segments, self.seen) if not seen))


class RecentHits:
    """The share of looked-up chunk blocks found (stored, or sighted), over the last `size`
    requests whose lookups count."""

    def __init__(self, size: int = RECENT_REQUESTS, evidence: int = EVIDENCE_REQUESTS):
        self._window: deque[tuple[int, int]] = deque(maxlen=size)
        self.evidence = evidence
        self.warm = False  # a request of this engine that looked chunks up has finished

    def add(self, found: int, looked_up: int, warm: bool = True) -> None:
        """Counts a lookup; `warm`: whether it was made after a request of this engine finished
        (`self.warm` then). A cold lookup counts only when what it found shows reuse by itself
        (ADMIT_ALL_HIT_SHARE): the little it finds otherwise (the block every prompt shares, stored
        by the first request's first step) says nothing about the rest."""
        if looked_up and (warm or found >= ADMIT_ALL_HIT_SHARE * looked_up):
            self._window.append((found, looked_up))

    def share(self) -> float | None:
        """None until `evidence` requests looked chunks up."""
        if len(self._window) < self.evidence:
            return None
        return sum(f for f, _ in self._window) / sum(n for _, n in self._window)


def reused_unstored(missed: Sequence[ChunkBlock], admission: Admission | None) -> int:
    """Chunk blocks a request computes whose chunk was sighted before (its KV not stored then):
    reuse the adaptive rule counts as it counts a hit."""
    return 0 if admission is None else sum(admission.admits(b.tokens) for b in missed)


def admits_first_sighting(policy: str, recent: RecentHits) -> bool:
    if policy != ADAPTIVE:
        return policy == FIRST_SIGHTING
    share = recent.share()
    return share is None or share >= ADMIT_ALL_HIT_SHARE
