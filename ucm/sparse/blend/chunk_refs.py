"""Chunk KV stored once: a chunk block as a reference into the exact blocks that hold its KV.

A prompt computed in full stores its exact prefix blocks. Its chunks' KV is in those blocks
already (computed after whatever text preceded each chunk, which is what chunk KV of the "any"
policy is), at the prompt's positions. Writing it a second time under chunk keys, K rotated back
to chunk-local positions, doubled what every cold request wrote. A reference instead names the
exact blocks covering the chunk block and the position its first token had there: a load reads
those rows and rotates K by (new position - old position). The reference is found under the
chunk block's key (kind CHUNK_REF) and is only as good as its exact blocks: a lookup checks they
are stored, and a load that fails falls back like any failed load.

Pure: encoding, decoding and the row arithmetic; the connector does the IO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from ucm.sparse.blend.chunking import Span
from ucm.sparse.blend.hashing import BlockHash

REF_FORMAT = 1
# Every reference is stored in this many bytes (zero padded): a load needs its size in advance.
REF_BYTES = 256


@dataclass(frozen=True)
class ChunkRef:
    """A chunk block of `num_tokens` tokens whose KV sits in the exact blocks `sources`, its first
    token at prompt position `position` (exact blocks of `block_size` tokens, the first one
    starting at `position // block_size * block_size`)."""

    position: int
    num_tokens: int
    block_size: int
    sources: tuple[BlockHash, ...]


@dataclass(frozen=True)
class RefPiece:
    """Rows [rows.start, rows.end) of the stored exact block `source`, placed at prompt positions
    from `start` on, K rotated by `rope_delta`."""

    source: BlockHash
    rows: Span
    start: int
    rope_delta: int


def covering_blocks(position: int, num_tokens: int, block_size: int) -> range:
    """Indices of the exact blocks holding positions [position, position + num_tokens)."""
    return range(position // block_size, (position + num_tokens - 1) // block_size + 1)


def make_ref(span: Span, exact_hashes: Sequence[BlockHash], block_size: int) -> ChunkRef | None:
    """The reference of a chunk block computed at prompt positions `span`, given the prompt's
    exact block hashes (full blocks only); None when some of its tokens have no exact block."""
    if len(span) <= 0:
        return None
    blocks = covering_blocks(span.start, len(span), block_size)
    if blocks.stop > len(exact_hashes):
        return None
    return ChunkRef(span.start, len(span), block_size, tuple(exact_hashes[b] for b in blocks))


def encode_ref(ref: ChunkRef) -> bytes:
    body = msgpack.packb([REF_FORMAT, ref.position, ref.num_tokens, ref.block_size, list(ref.sources)])
    if len(body) > REF_BYTES:
        raise ValueError(f"a chunk reference of {len(ref.sources)} sources needs {len(body)} bytes (> {REF_BYTES})")
    return body + bytes(REF_BYTES - len(body))


def decode_ref(data: bytes, num_tokens: int, block_size: int) -> ChunkRef | None:
    """The reference in `data`, or None when it is not one of a `num_tokens`-token chunk block
    under this block size (another format, a damaged record, a different block geometry)."""
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(bytes(data))
        fmt, position, n, bs, sources = next(unpacker)
    except Exception:  # any malformed record is a miss, never an error
        return None
    if fmt != REF_FORMAT or n != num_tokens or bs != block_size or not isinstance(position, int) or position < 0:
        return None
    if not isinstance(sources, list) or not all(isinstance(s, bytes) for s in sources):
        return None
    if len(sources) != len(covering_blocks(position, n, bs)):
        return None
    return ChunkRef(position, n, bs, tuple(BlockHash(s) for s in sources))


def ref_pieces(ref: ChunkRef, placed: Span, block_start: int) -> list[RefPiece]:
    """Where the rows of a referenced chunk block go: the block's tokens start at prompt position
    `block_start` in the new prompt, and only `placed` (a tail of them) is written."""
    bs = ref.block_size
    delta = block_start - ref.position
    first = ref.position + (placed.start - block_start)  # old position of the first placed token
    end = ref.position + (placed.end - block_start)
    pieces = []
    base = ref.position // bs
    for b in covering_blocks(first, end - first, bs) if end > first else ():
        lo, hi = max(first, b * bs), min(end, (b + 1) * bs)
        pieces.append(RefPiece(ref.sources[b - base], Span(lo - b * bs, hi - b * bs), lo + delta, delta))
    return pieces
