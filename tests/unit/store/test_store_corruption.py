"""Damaged block files are detected, reported as misses, counted, and removed."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from ucm.store.block_format import HEADER_REGION

from _store_test_helpers import block_for, key_of

SIZE = 300_000  # spans two native IO chunks


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def _append(path: str, _: int) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


def _other_key(path: str, _: int, *, donor: str) -> None:
    shutil.copyfile(donor, path)


DAMAGE = {
    "flip first payload byte": lambda p: _flip(p, HEADER_REGION),
    "flip last payload byte": lambda p: _flip(p, HEADER_REGION + SIZE - 1),
    "flip middle payload byte": lambda p: _flip(p, HEADER_REGION + SIZE // 2 + 3),
    "flip checksum in header": lambda p: _flip(p, 12 + 80),
    "flip magic": lambda p: _flip(p, 0),
    "flip header length": lambda p: _flip(p, 10),
    "truncate payload": lambda p: _truncate(p, HEADER_REGION + SIZE - 1),
    "truncate into header": lambda p: _truncate(p, 100),
    "truncate to empty": lambda p: _truncate(p, 0),
    "trailing garbage": lambda p: _append(p, 0),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_block_is_a_counted_miss_and_is_removed(make_store, damage):
    store = make_store()
    keys = [key_of(i) for i in range(3)]
    sources = [block_for(k, SIZE) for k in keys]
    assert all(store.wait(store.dump(keys, sources, [1, 2, 3])))
    victim = store.block_path(keys[1])
    DAMAGE[damage](victim)

    dests = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert store.wait(store.load(keys, dests)) == [True, False, True]
    assert np.array_equal(dests[0], sources[0]) and np.array_equal(dests[2], sources[2])
    stats = store.stats()
    assert (stats.load_blocks, stats.load_errors, stats.checksum_errors) == (2, 1, 1)
    assert not os.path.exists(victim), "a corrupt block is removed so it can be recomputed"
    assert store.lookup(keys) == [True, False, True]
    # The key can be stored again and then loads correctly.
    assert store.wait(store.dump([keys[1]], [sources[1]], [2])) == [True]
    assert store.wait(store.load([keys[1]], [dests[1]])) == [True]
    assert np.array_equal(dests[1], sources[1])


def test_block_of_another_key_under_this_name_is_rejected(make_store):
    store = make_store()
    a, b = key_of(1), key_of(2)
    assert all(store.wait(store.dump([a, b], [block_for(a, SIZE), block_for(b, SIZE)], [1, 1])))
    shutil.copyfile(store.block_path(a), store.block_path(b))
    dest = np.zeros(SIZE, np.uint8)
    assert store.wait(store.load([b], [dest])) == [False]
    assert store.stats().checksum_errors == 1
