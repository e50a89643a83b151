"""The block file is readable from Python: fixed prefix, msgpack header, payload at 4096."""

from __future__ import annotations

import os
import struct

import msgpack
import numpy as np
import pytest
import xxhash

from ucm.store import _native
from ucm.store.block_format import FORMAT_VERSION, HEADER_REGION, MAGIC, PREFIX, IoStatus, parse_header, read_header

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
    assert fields == {
        "version": 1,
        "payload_offset": 4096,
        "payload_len": size,
        "token_count": 77,
        "xxh64": xxhash.xxh64(payload.tobytes()).intdigest(),
        "key": key,
    }
    assert raw[12 + length : HEADER_REGION] == bytes(HEADER_REGION - 12 - length)
    assert raw[HEADER_REGION:] == payload.tobytes()
    assert read_header(store.block_path(key)).token_count == 77


def _python_block(key: bytes, payload: bytes, **overrides) -> bytes:
    fields = {"version": 1, "payload_offset": 4096, "payload_len": len(payload), "token_count": 3,
              "xxh64": xxhash.xxh64(payload).intdigest(), "key": key, **overrides}
    header = msgpack.packb(fields)
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
    _write(store.block_path(key), _python_block(key, payload, version=2))
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
