"""Store keys: fixed-size digests of (namespace, kind, block hash).

Block hashes of vLLM's prefix cache do not name the model, so the namespace (an opaque string
the caller derives from model, dtype and KV geometry) keeps KV of different models apart in one
shared directory. The kind keeps exact prefix KV apart from chunk KV that was computed in
another context: a prefix lookup only ever accepts EXACT keys.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import NewType

KEY_BYTES = 32

# A block's name in the store (what lookup, load and dump take). Not a block hash: it also names
# the model namespace and the kind.
StoreKey = NewType("StoreKey", bytes)


class KeyKind(bytes, Enum):
    EXACT = b"x"  # KV computed with exactly the prefix the block hash chains over
    CHUNK = b"c"  # KV of a chunk computed after other text, stored at chunk-local positions
    CHUNK_REF = b"r"  # not KV: where a chunk block's KV sits in stored EXACT blocks (sparse/blend/chunk_refs.py)
    SIGHTING = b"s"  # not KV: a prompt segment was computed once (sparse/blend/admission.py)


def store_key(namespace: bytes, kind: KeyKind, block_hash: bytes) -> StoreKey:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(len(namespace).to_bytes(4, "little"))
    h.update(namespace)
    h.update(kind.value)
    h.update(block_hash)
    return StoreKey(h.digest())


def shard_key(key: StoreKey, shard: int, num_shards: int) -> StoreKey:
    """The key of one shard of a block split over `num_shards` writers (tensor-parallel ranks).

    Each rank holds only its own heads, so a block is stored as one file per rank; a reader with
    another shard count finds none of them. One shard is the block itself (unchanged key).
    """
    if num_shards == 1:
        return key
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(key)
    h.update(b"shard")
    h.update(shard.to_bytes(4, "little"))
    h.update(num_shards.to_bytes(4, "little"))
    return StoreKey(h.digest())
