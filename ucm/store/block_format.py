"""Block file format, readable from Python (the native engine writes and verifies it).

Layout: magic "UCMKVBLK" | u32 LE msgpack header length | msgpack header map, zero padded to
HEADER_REGION bytes | payload. The payload starts at 4096 so O_DIRECT reads land aligned.
Version 1: `xxh64` covers the payload. Version 2 (`SEGMENTED_VERSION`): the payload is several
equal segments (the connector's: one per model layer), `segments` lists each one's XXH64 so a
segment can be read and verified alone, and `xxh64` is the XXH64 of that list. `header_xxh64`
covers the other header fields (`header_digest`): a damaged token count, key or segment list is
caught like a damaged payload.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass

import msgpack
import xxhash

MAGIC = b"UCMKVBLK"
PREFIX = struct.Struct("<8sI")
HEADER_REGION = 4096
FORMAT_VERSION = 1
SEGMENTED_VERSION = 2
MAX_SEGMENTS = 256
BLOCK_SUFFIX = ".kvb"


class IoStatus(enum.IntEnum):
    """Per-block result codes of the native engine (must match csrc/store_io.cpp)."""

    OK = 0
    NOT_FOUND = 1
    BAD_HEADER = 2
    LENGTH_MISMATCH = 3
    CHECKSUM_MISMATCH = 4
    IO_ERROR = 5
    TRUNCATED = 6
    EXISTS = 7
    UNSUPPORTED_VERSION = 8  # another format version wrote it; not ours to judge or delete
    NOT_SEGMENTED = 9  # a segment read of a block stored without those segments; left alone


# A stored block whose bytes cannot be trusted; it is removed so it stops answering lookups.
# A damaged payload_len reads as LENGTH_MISMATCH (keys name the KV geometry, so a stored block of
# another length is not a legitimate one); kept, it would look stored and never load.
CORRUPT_STATUSES = frozenset({IoStatus.BAD_HEADER, IoStatus.CHECKSUM_MISMATCH, IoStatus.TRUNCATED,
                              IoStatus.LENGTH_MISMATCH})


@dataclass(frozen=True)
class BlockHeader:
    version: int
    payload_offset: int
    payload_len: int
    token_count: int
    xxh64: int
    key: bytes
    header_xxh64: int = 0
    segments: tuple[int, ...] = ()  # version 2: each segment's XXH64


_HEADER_FIELDS = ("version", "payload_offset", "payload_len", "token_count", "xxh64", "key", "header_xxh64")


def header_digest(h: BlockHeader) -> int:
    """XXH64 of the header fields other than itself (must match csrc/store_io.cpp)."""
    fields = struct.pack("<5Q", h.version, h.payload_offset, h.payload_len, h.token_count, h.xxh64)
    return xxhash.xxh64(fields + h.key, seed=0).intdigest()


def segments_digest(segments) -> int:
    """Version 2's `xxh64`: the XXH64 of the segment checksums, u64 LE each."""
    return xxhash.xxh64(struct.pack(f"<{len(segments)}Q", *segments), seed=0).intdigest()


def file_size(payload_len: int) -> int:
    return HEADER_REGION + payload_len


def parse_header(region: bytes) -> BlockHeader:
    """Decode the header region of a block file; raises ValueError if it is not one."""
    if len(region) < PREFIX.size:
        raise ValueError("block file shorter than its prefix")
    magic, length = PREFIX.unpack_from(region)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if PREFIX.size + length > min(len(region), HEADER_REGION):
        raise ValueError(f"header length {length} exceeds the header region")
    # The first msgpack object is the header; what follows it up to `length` is ignored, as the
    # native reader does (the fields are covered by header_xxh64, trailing bytes are not).
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=HEADER_REGION)
    unpacker.feed(region[PREFIX.size : PREFIX.size + length])
    try:
        fields = unpacker.unpack()
    except Exception as e:  # msgpack's errors for malformed input are not all ValueErrors
        raise ValueError(f"unreadable block header: {e}") from e
    if not isinstance(fields, dict):
        raise ValueError(f"block header is a {type(fields).__name__}, not a map")
    try:
        header = BlockHeader(**{name: fields[name] for name in _HEADER_FIELDS})
    except KeyError as e:
        raise ValueError(f"incomplete block header: missing {e}") from e
    for name in _HEADER_FIELDS:
        value = getattr(header, name)
        if name == "key" and not isinstance(value, bytes):
            raise ValueError(f"block header key is a {type(value).__name__}, not bytes")
        if name != "key" and not (type(value) is int and 0 <= value < 1 << 64):
            raise ValueError(f"block header {name} is not a u64: {value!r}")
    if header.version not in (FORMAT_VERSION, SEGMENTED_VERSION):
        raise ValueError(f"unsupported block format version {header.version}")
    if header_digest(header) != header.header_xxh64:
        raise ValueError("block header checksum mismatch")
    if header.version == SEGMENTED_VERSION:
        segments = fields.get("segments")
        if (not isinstance(segments, list) or not 0 < len(segments) <= MAX_SEGMENTS
                or not all(type(d) is int and 0 <= d < 1 << 64 for d in segments)):
            raise ValueError(f"version 2 block header without a valid segment list: {segments!r}")
        if header.payload_len % len(segments) or segments_digest(segments) != header.xxh64:
            raise ValueError("block header segment list does not match its checksum or payload length")
        header = dataclasses.replace(header, segments=tuple(segments))
    elif "segments" in fields:
        raise ValueError("version 1 block header with a segment list")
    return header


def read_header(path: str) -> BlockHeader:
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_REGION))
