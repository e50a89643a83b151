"""Mutated block headers, as a shared directory may hold them: both parsers reject or read correctly.

A block file in the shared store may be damaged by any writer, disk or mount. Its header is parsed
by the native engine (loads) and by Python (`read_meta`, the audit): every mutation must give a
miss or the original header, never an exception, a crash or wrong bytes.
"""

from __future__ import annotations

import random

import numpy as np

from ucm.store.block_format import HEADER_REGION, PREFIX, parse_header

from _store_test_helpers import block_for, key_of

SIZE = 4096
MUTATIONS = 3000


def _mutate(header: bytearray, used: int, rng: random.Random) -> bytearray:
    """One to four random edits inside the prefix and msgpack bytes (or just past them)."""
    out = bytearray(header)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(used + 8)
        kind = rng.random()
        if kind < 0.5:
            out[pos] ^= 1 << rng.randrange(8)  # a bit flip
        elif kind < 0.8:
            out[pos] = rng.randrange(256)  # a random byte
        elif kind < 0.9:
            out[pos] = rng.choice((0x00, 0x7f, 0x80, 0xc1, 0xcb, 0xcf, 0xd9, 0xdc, 0xdd, 0xdf, 0xff))  # type bytes
        else:  # the msgpack length claims another size
            length = rng.choice((0, 1, used - PREFIX.size - 1, used, HEADER_REGION, 2**32 - 1))
            out[8:12] = (length % 2**32).to_bytes(4, "little")
    return out


def test_mutated_headers_are_rejected_or_read_correctly(make_store):
    store = make_store()
    key = key_of(7)
    payload = block_for(key, SIZE)
    assert store.wait(store.dump([key], [payload], [16])) == [True]
    path = store.block_path(key)
    with open(path, "rb") as f:
        original = f.read()
    header = parse_header(original[:HEADER_REGION])
    used = PREFIX.size + int.from_bytes(original[8:12], "little")
    rng = random.Random(0)
    outcomes = {"python_rejected": 0, "native_rejected": 0, "read": 0}
    for i in range(MUTATIONS):
        mutated = _mutate(bytearray(original[:HEADER_REGION]), used, rng)
        try:
            parsed = parse_header(bytes(mutated))
        except ValueError:
            parsed = None
            outcomes["python_rejected"] += 1
        assert parsed is None or parsed == header, f"mutation {i}: Python read a different header"

        with open(path, "wb") as f:  # the damaged file replaces the block (a failed load removes it)
            f.write(bytes(mutated) + original[HEADER_REGION:])
        meta = store.read_meta([key])[0]
        assert meta is None or (meta.payload_len, meta.token_count) == (SIZE, 16), f"mutation {i}: {meta}"
        dest = np.zeros(SIZE, np.uint8)
        ok = store.wait(store.load([key], [dest]))[0]
        if ok:
            assert np.array_equal(dest, payload), f"mutation {i}: the engine served wrong bytes"
            outcomes["read"] += 1
        else:
            outcomes["native_rejected"] += 1
        assert ok == (parsed is not None), f"mutation {i}: the parsers disagree (Python {parsed}, native {ok})"
    # Most mutations land in the fields or the msgpack framing and must be caught.
    assert outcomes["python_rejected"] > MUTATIONS // 2, outcomes
