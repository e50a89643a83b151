"""Block file format, readable from Python (the native engine writes and verifies it).

Layout: magic "UCMKVBLK" | u32 LE msgpack header length | msgpack header map, zero padded to
HEADER_REGION bytes | payload. The payload starts at 4096 so O_DIRECT reads land aligned.
`xxh64` covers the payload and `header_xxh64` the other header fields (`header_digest`): a
damaged token count or key is caught like a damaged payload.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import msgpack
import xxhash

MAGIC = b"UCMKVBLK"
PREFIX = struct.Struct("<8sI")
HEADER_REGION = 4096
FORMAT_VERSION = 1
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


def header_digest(h: BlockHeader) -> int:
    """XXH64 of the header fields other than itself (must match csrc/store_io.cpp)."""
    fields = struct.pack("<5Q", h.version, h.payload_offset, h.payload_len, h.token_count, h.xxh64)
    return xxhash.xxh64(fields + h.key, seed=0).intdigest()


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
    fields = msgpack.unpackb(region[PREFIX.size : PREFIX.size + length], raw=False)
    try:
        header = BlockHeader(
            version=fields["version"],
            payload_offset=fields["payload_offset"],
            payload_len=fields["payload_len"],
            token_count=fields["token_count"],
            xxh64=fields["xxh64"],
            key=fields["key"],
            header_xxh64=fields["header_xxh64"],
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"incomplete block header: {e}") from e
    if header.version != FORMAT_VERSION:
        raise ValueError(f"unsupported block format version {header.version}")
    if header_digest(header) != header.header_xxh64:
        raise ValueError("block header checksum mismatch")
    return header


def read_header(path: str) -> BlockHeader:
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_REGION))
