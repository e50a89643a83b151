"""Block hashes in vLLM's prefix-cache hash space, without importing vLLM.

CacheBlend stores each chunk's KV under block hashes computed as if the chunk
were a prompt of its own (chained from the same root as every prompt). A chunk
stored at position 0 therefore shares its hashes with vLLM's own prefix cache
(``Request.block_hashes``), and the same chunk at any other offset is still
found. This module mirrors vLLM 0.32 exactly
(``vllm.utils.hashing`` and ``vllm.v1.core.kv_cache_utils``):

* ``hash_fn(obj)``: ``sha256``/``xxhash`` (xxh3-128) over
  ``pickle.dumps(obj, HIGHEST_PROTOCOL)``, or over ``cbor2.dumps(obj,
  canonical=True)`` for the ``*_cbor`` variants.
* block hash: ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``.
* ``NONE_HASH = hash_fn(seed)`` where the seed *string* is hashed:
  ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"`` for sha256 algos and
  32 random bytes (hex) per process for xxhash algos.

Token ids are converted to Python ints first: pickle encodes numpy/torch ints
differently, which would silently break equality with vLLM.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

__all__ = [
    "HASH_ALGOS",
    "DEFAULT_NONE_HASH_SEED",
    "get_hash_fn",
    "resolve_none_hash_seed",
    "hash_block_tokens",
    "BlockHasher",
    "IsolationKeys",
]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's seed for collision-resistant algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})

HashFn = Callable[[Any], bytes]
# A block's hash in vLLM's prefix-cache hash space (vLLM's kv_cache_utils.BlockHash): exact
# prefix blocks and chunk blocks alike; chunk blocks chain from NONE_HASH at their chunk's start.
BlockHash = NewType("BlockHash", bytes)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2  # vLLM dependency; only needed for the *_cbor algos

    return cbor2.dumps(obj, canonical=True)


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128_digest(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _sha256(obj: Any) -> bytes:
    return _sha256_digest(_pickle(obj))


def _sha256_cbor(obj: Any) -> bytes:
    return _sha256_digest(_cbor(obj))


def _xxhash(obj: Any) -> bytes:
    return _xxh3_128_digest(_pickle(obj))


def _xxhash_cbor(obj: Any) -> bytes:
    return _xxh3_128_digest(_cbor(obj))


_HASH_FNS: dict[str, HashFn] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def get_hash_fn(algo: str) -> HashFn:
    """Hash function named like vLLM's ``prefix_caching_hash_algo``."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(
            f"unsupported prefix-caching hash algo {algo!r}; expected one of {HASH_ALGOS}"
        ) from None


def resolve_none_hash_seed(algo: str, seed: str | None = None) -> str:
    """The seed vLLM derives NONE_HASH from, with ``seed`` overriding the env.

    Pass the serving engine's ``PYTHONHASHSEED`` as ``seed``. For xxhash algos
    without any seed vLLM picks a random one per process; we do the same, but
    such hashes can never match another process's, so blending needs a seed.
    """
    get_hash_fn(algo)  # validate
    if seed is not None:
        return seed
    env_seed = os.getenv("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if algo in _NON_CRYPTO_ALGOS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def hash_block_tokens(
    hash_fn: HashFn,
    parent: BlockHash | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None,
    none_hash: bytes,
) -> BlockHash:
    """One chained block hash; a falsy ``parent`` (None or b"") means the root."""
    return BlockHash(hash_fn((parent or none_hash, _int_tuple(tokens), extra_keys)))


@dataclass(frozen=True)
class IsolationKeys:
    """What keeps requests apart in vLLM's prefix cache, as its block-hash extra keys.

    vLLM 0.32 (`generate_block_hash_extra_keys`) adds the LoRA adapter, ``("lora", name, path)``,
    to every block and ``("cache_salt", salt)`` to the first. Chunk hashes carry the same keys,
    so two requests share chunk KV exactly when they could share a prefix: never across tenants
    (salts) or adapters, and a chunk at position 0 keeps the request's own prefix hashes.
    """

    lora: tuple[str, str, str] | None = None
    cache_salt: str | None = None

    def block_keys(self, index: int) -> tuple[Any, ...] | None:
        keys: list[Any] = [self.lora] if self.lora else []
        if index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


@dataclass
class BlockHasher:
    """Chained block hashing for one algo, block size and root (NONE_HASH).

    ``block_size`` must be vLLM's *hash* block size (``Request.block_hashes``
    granularity), which equals the KV block size for single-group models.
    """

    algo: str
    block_size: int
    none_hash: bytes

    def __post_init__(self) -> None:
        self._hash_fn = get_hash_fn(self.algo)
        if isinstance(self.block_size, bool) or int(self.block_size) != self.block_size:
            raise ValueError(f"block_size must be an int, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def from_seed(cls, algo: str, block_size: int, seed: str | None) -> BlockHasher:
        """Root the chain like vLLM's ``init_none_hash`` (see resolve_none_hash_seed)."""
        none_hash = get_hash_fn(algo)(resolve_none_hash_seed(algo, seed))
        return cls(algo, block_size, none_hash)

    @property
    def hash_fn(self) -> HashFn:
        return self._hash_fn

    def hash_block(
        self,
        parent: BlockHash | None,
        tokens: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        """Hash of one block given its parent's hash (None for the first block)."""
        return hash_block_tokens(self._hash_fn, parent, tokens, extra_keys, self.none_hash)

    def prefix_hashes(
        self,
        tokens: Sequence[int],
        parent: BlockHash | None = None,
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` (vLLM's ``Request.block_hashes``).

        ``parent`` continues an existing chain; ``extra_keys`` gives one entry
        per full block (LoRA / multimodal / cache-salt keys, as vLLM builds them).
        """
        toks = _int_tuple(tokens)
        bs = self.block_size
        num_blocks = len(toks) // bs
        if extra_keys is not None and len(extra_keys) != num_blocks:
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries for {num_blocks} full blocks"
            )
        out: list[BlockHash] = []
        for i in range(num_blocks):
            keys = None if extra_keys is None else extra_keys[i]
            parent = self.hash_block(parent, toks[i * bs : (i + 1) * bs], keys)
            out.append(parent)
        return out

    def chunk_hashes(self, tokens: Sequence[int], isolation: IsolationKeys | None = None) -> list[BlockHash]:
        """Keys of a chunk's stored KV: its prefix hashes plus a trailing partial one.

        Rooted like a prompt of the same tenant and adapter (``isolation``), so a
        chunk at position 0 has exactly the prompt's prefix hashes. The partial
        last block (``len % block_size`` tokens) is hashed with the same formula;
        its shorter token tuple serialises differently from any full block, so it
        cannot alias one.
        """
        toks = _int_tuple(tokens)
        iso = isolation or IsolationKeys()
        num_full = len(toks) // self.block_size
        hashes = self.prefix_hashes(toks, extra_keys=[iso.block_keys(i) for i in range(num_full)])
        tail = len(toks) % self.block_size
        if tail:
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_block(parent, toks[len(toks) - tail :], iso.block_keys(num_full)))
        return hashes


def _int_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    if isinstance(tokens, tuple) and all(type(t) is int for t in tokens):
        return tokens
    tolist = getattr(tokens, "tolist", None)  # numpy arrays / torch tensors
    if tolist is not None:
        return tuple(tolist())
    return tuple(map(int, tokens))
