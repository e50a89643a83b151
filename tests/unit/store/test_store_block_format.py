"""The block file is readable from Python: fixed prefix, msgpack header, payload at 4096."""

from __future__ import annotations

import os
import struct

import msgpack
import numpy as np
import pytest
import xxhash

from ucm.store import _native
from ucm.store.block_format import (FORMAT_VERSION, HEADER_REGION, MAGIC, PREFIX, BlockHeader, IoStatus, header_digest,
                                    parse_header, read_header)

from _store_test_helpers import block_for, key_of


def test_python_constants_match_the_native_engine():
    assert {s.name: s.value for s in IoStatus} == _native.STATUS_CODES
    assert (_native.MAGIC, _native.PREFIX_SIZE, _native.HEADER_REGION, _native.FORMAT_VERSION) == (
        MAGIC, PREFIX.size, HEADER_REGION, FORMAT_VERSION)


@pytest.mark.parametrize("size", [0, 1, 4096, (256 << 10) + 1, (1 << 20) + 5])
def test_written_file_decodes_with_msgpack(make_store, size):
    store = make_store()
    key = key_of(size, length=32)
    payload = block_for(key, size)
    assert store.wait(store.dump([key], [payload], [77])) == [True]

    raw = open(store.block_path(key), "rb").read()
    assert len(raw) == HEADER_REGION + size
    magic, length = struct.unpack_from("<8sI", raw)
    assert magic == b"UCMKVBLK"
    fields = msgpack.unpackb(raw[12 : 12 + length])
    header = fields.pop("header_xxh64")
    assert fields == {
        "version": 1,
        "payload_offset": 4096,
        "payload_len": size,
        "token_count": 77,
        "xxh64": xxhash.xxh64(payload.tobytes()).intdigest(),
        "key": key,
    }
    assert header == header_digest(BlockHeader(**fields))
    assert raw[12 + length : HEADER_REGION] == bytes(HEADER_REGION - 12 - length)
    assert raw[HEADER_REGION:] == payload.tobytes()
    assert read_header(store.block_path(key)).token_count == 77


def _python_block(key: bytes, payload: bytes, /, header_xxh64: int | None = None, **overrides) -> bytes:
    known = {"version": 1, "payload_offset": 4096, "payload_len": len(payload), "token_count": 3,
             "xxh64": xxhash.xxh64(payload).intdigest(), "key": key}
    extra = {k: overrides.pop(k) for k in list(overrides) if k not in known}
    known.update(overrides)
    digest = header_digest(BlockHeader(**known)) if header_xxh64 is None else header_xxh64
    header = msgpack.packb({**known, "header_xxh64": digest, **extra})
    region = PREFIX.pack(MAGIC, len(header)) + header
    return region.ljust(HEADER_REGION, b"\0") + payload


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_engine_reads_python_written_blocks_with_unknown_fields_of_any_type(make_store):
    """A newer writer may add header fields; this version must still verify and load its blocks."""
    store = make_store()
    key = key_of(1)
    payload = block_for(key, 5000).tobytes()
    extra = {"writer": "future", "flags": [1, -2, None, True], "nested": {"a": 1.5, 7: b"x"}, "big": -(2**40)}
    _write(store.block_path(key), _python_block(key, payload, **extra))
    dest = np.zeros(5000, dtype=np.uint8)
    assert store.wait(store.load([key], [dest])) == [True]
    assert dest.tobytes() == payload


def test_other_format_version_is_a_miss_and_is_left_in_place(make_store):
    """During a rolling upgrade, blocks of another format version belong to the other version."""
    store = make_store()
    key = key_of(2)
    payload = block_for(key, 5000).tobytes()
    _write(store.block_path(key), _python_block(key, payload, version=3))
    dest = np.zeros(5000, dtype=np.uint8)
    assert store.wait(store.load([key], [dest])) == [False]
    assert os.path.exists(store.block_path(key))
    stats = store.stats()
    assert (stats.load_errors, stats.checksum_errors) == (1, 0)


def test_parse_header_rejects_garbage():
    with pytest.raises(ValueError, match="magic"):
        parse_header(b"NOTABLOCK" + bytes(4096))
    with pytest.raises(ValueError, match="shorter"):
        parse_header(b"UCM")


@pytest.mark.parametrize("field,value", [("token_count", 4), ("key", None)])
def test_damaged_header_field_is_detected_removed_and_never_served(make_store, field, value):
    """token_count and key are outside the payload checksum; the header checksum covers them."""
    store = make_store()
    key = key_of(3)
    payload = block_for(key, 5000).tobytes()
    good = _python_block(key, payload)
    digest = msgpack.unpackb(good[PREFIX.size:PREFIX.size + PREFIX.unpack_from(good)[1]])["header_xxh64"]
    damaged = {field: value if value is not None else key[:-1] + bytes([key[-1] ^ 1])}
    path = store.block_path(key)
    _write(path, _python_block(key, payload, header_xxh64=digest, **damaged))
    with pytest.raises(ValueError, match="header checksum"):
        read_header(path)
    assert store.read_meta([key]) == [None]
    dest = np.zeros(5000, dtype=np.uint8)
    assert store.wait(store.load([key], [dest])) == [False]
    assert not os.path.exists(path) and store.stats().checksum_errors == 1


def test_block_without_header_checksum_is_removed(make_store):
    """Blocks written before the header checksum existed are recomputed once, not kept unreadable."""
    store = make_store()
    key = key_of(4)
    payload = block_for(key, 5000).tobytes()
    fields = {"version": 1, "payload_offset": 4096, "payload_len": len(payload), "token_count": 3,
              "xxh64": xxhash.xxh64(payload).intdigest(), "key": key}
    header = msgpack.packb(fields)
    _write(store.block_path(key), (PREFIX.pack(MAGIC, len(header)) + header).ljust(HEADER_REGION, b"\0") + payload)
    assert store.wait(store.load([key], [np.zeros(5000, dtype=np.uint8)])) == [False]
    assert not os.path.exists(store.block_path(key))
