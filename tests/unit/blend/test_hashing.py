"""Our block hashes must be bit-identical to vLLM's prefix-cache hashes."""

import hashlib
import pickle
import random

import numpy as np
import pytest

from ucm.sparse.blend.hashing import (
    IsolationKeys,
    DEFAULT_NONE_HASH_SEED,
    HASH_ALGOS,
    BlockHasher,
    get_hash_fn,
    resolve_none_hash_seed,
)

kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vhash = pytest.importorskip("vllm.utils.hashing")
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK = 16
SEED = "1234"


def vllm_none_hash(algo: str, monkeypatch, seed: str | None) -> bytes:
    """Let vLLM itself derive NONE_HASH (it reads PYTHONHASHSEED)."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kcu.init_none_hash(vhash.get_hash_fn_by_name(algo))
    return kcu.NONE_HASH


def vllm_chain(algo: str, tokens, extra=None) -> list[bytes]:
    fn = vhash.get_hash_fn_by_name(algo)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        keys = None if extra is None else extra[i]
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * BLOCK : (i + 1) * BLOCK], keys)
        out.append(parent)
    return out


@pytest.fixture
def tokens():
    rng = random.Random(0)
    return [rng.randrange(0, 150_000) for _ in range(5 * BLOCK + 7)]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_fn_matches_vllm(algo):
    ours, theirs = get_hash_fn(algo), vhash.get_hash_fn_by_name(algo)
    for obj in ["vllm-none-hash", (b"\x00" * 32, (1, 2, 3), None), (b"x", (), (("lora", "a", "b"),))]:
        assert ours(obj) == theirs(obj)


def test_sha256_is_pickle_sha256():
    obj = (b"p", (1, 2), None)
    assert get_hash_fn("sha256")(obj) == hashlib.sha256(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)).digest()


def test_unknown_algo():
    with pytest.raises(ValueError, match="unsupported"):
        get_hash_fn("md5")
    with pytest.raises(ValueError):
        BlockHasher("md5", BLOCK, b"")
    with pytest.raises(ValueError):
        BlockHasher("sha256", 0, b"")


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_none_hash_with_explicit_seed_matches_vllm(algo, monkeypatch):
    theirs = vllm_none_hash(algo, monkeypatch, SEED)
    ours = BlockHasher.from_seed(algo, BLOCK, SEED)
    assert ours.none_hash == theirs
    # The env is honoured when no explicit seed is given, like vLLM.
    assert BlockHasher.from_seed(algo, BLOCK, None).none_hash == theirs


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_crypto_algos_default_seed_matches_vllm(algo, monkeypatch):
    theirs = vllm_none_hash(algo, monkeypatch, None)
    assert kcu.DEFAULT_NONE_HASH_SEED == DEFAULT_NONE_HASH_SEED
    assert BlockHasher.from_seed(algo, BLOCK, None).none_hash == theirs
    assert resolve_none_hash_seed(algo) == DEFAULT_NONE_HASH_SEED


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_seed_is_random_per_call(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a = BlockHasher.from_seed(algo, BLOCK, None).none_hash
    b = BlockHasher.from_seed(algo, BLOCK, None).none_hash
    assert a != b
    assert resolve_none_hash_seed(algo, "7") == "7"


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_prefix_hashes_match_vllm_chain_and_request(algo, tokens, monkeypatch):
    vllm_none_hash(algo, monkeypatch, SEED)
    hasher = BlockHasher.from_seed(algo, BLOCK, SEED)
    ours = hasher.prefix_hashes(tokens)
    assert len(ours) == len(tokens) // BLOCK == 5
    assert ours == vllm_chain(algo, tokens)

    block_hasher = kcu.get_request_block_hasher(BLOCK, vhash.get_hash_fn_by_name(algo))
    req = Request("r", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=block_hasher)
    assert list(req.block_hashes) == ours

    # Non-Python ints must hash like Python ints.
    assert hasher.prefix_hashes(np.array(tokens, dtype=np.int64)) == ours
    # Continuing a chain equals hashing the whole prefix.
    assert hasher.prefix_hashes(tokens[2 * BLOCK :], parent=ours[1]) == ours[2:]


def test_extra_keys_match_vllm_cache_salt(tokens, monkeypatch):
    algo = "sha256"
    vllm_none_hash(algo, monkeypatch, SEED)
    hasher = BlockHasher.from_seed(algo, BLOCK, SEED)
    block_hasher = kcu.get_request_block_hasher(BLOCK, vhash.get_hash_fn_by_name(algo))
    req = Request(
        "r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt="salt", block_hasher=block_hasher
    )
    extra = [(("cache_salt", "salt"),)] + [None] * 4
    assert hasher.prefix_hashes(tokens, extra_keys=extra) == list(req.block_hashes)
    assert hasher.prefix_hashes(tokens, extra_keys=extra) != hasher.prefix_hashes(tokens)
    with pytest.raises(ValueError, match="extra_keys"):
        hasher.prefix_hashes(tokens, extra_keys=extra[:2])


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("lora", [None, ("adapter", 7, "/adapters/a")])
def test_chunk_hashes_carry_vllm_isolation_keys(tokens, monkeypatch, salt, lora):
    """A chunk at position 0 of a salted or LoRA request has that request's own block hashes;
    any other salt or adapter gives other keys (requests that cannot share a prefix cannot share
    chunk KV)."""
    from vllm.lora.request import LoRARequest

    algo = "sha256"
    vllm_none_hash(algo, monkeypatch, SEED)
    hasher = BlockHasher.from_seed(algo, BLOCK, SEED)
    lora_request = LoRARequest(lora[0], lora[1], lora[2]) if lora else None
    block_hasher = kcu.get_request_block_hasher(BLOCK, vhash.get_hash_fn_by_name(algo))
    req = Request("r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt=salt, lora_request=lora_request,
                  block_hasher=block_hasher)
    iso = IsolationKeys(("lora", lora[0], lora[2]) if lora else None, salt)
    assert hasher.chunk_hashes(tokens, iso)[:5] == list(req.block_hashes)
    others = [IsolationKeys(iso.lora, "tenant-b"), IsolationKeys(("lora", "other", "/adapters/b"), salt),
              IsolationKeys(None, None if salt else "tenant-b")]
    for other in others:
        if other != iso:
            assert not set(hasher.chunk_hashes(tokens, other)) & set(hasher.chunk_hashes(tokens, iso))
    # The partial tail carries the keys too (the adapter on every block, the salt on the first).
    short = tokens[: BLOCK - 3]
    assert hasher.chunk_hashes(short, iso) == [hasher.hash_block(None, short, iso.block_keys(0))]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_chunk_hashes(algo, tokens, monkeypatch):
    vllm_none_hash(algo, monkeypatch, SEED)
    fn = vhash.get_hash_fn_by_name(algo)
    hasher = BlockHasher.from_seed(algo, BLOCK, SEED)

    # A chunk at position 0 has exactly the prompt's prefix hashes, plus the tail.
    got = hasher.chunk_hashes(tokens)
    full = vllm_chain(algo, tokens)
    assert got[:-1] == full
    assert got[-1] == kcu.hash_block_tokens(fn, full[-1], tokens[5 * BLOCK :], None)
    assert len(set(got)) == len(got)

    # Block-aligned chunk: no partial hash.
    assert hasher.chunk_hashes(tokens[: 2 * BLOCK]) == full[:2]

    # Chunk shorter than a block: one hash from the root over the partial tuple.
    short = tokens[:5]
    assert hasher.chunk_hashes(short) == [kcu.hash_block_tokens(fn, None, short, None)]
    assert hasher.chunk_hashes([]) == []

    # The partial hash of a prefix never equals the full block's hash.
    assert hasher.chunk_hashes(tokens[: BLOCK - 1])[0] != full[0]
