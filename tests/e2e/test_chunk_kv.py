"""Stored chunk KV, read back from the store and shifted, equals the chunk computed at a new offset.

The Blend engine computes a prompt made of ONE chunk (a passage closed by the marker token) and
a short suffix. The chunk opens the prompt, so its KV is exact and the connector stores it: the
full blocks as exact prefix blocks (under vLLM's own block hashes), the partial tail block under
the chunk hash of its tokens, also as an EXACT key. The test reads those blocks back with its own
store instance and compares them with an independent computation: the same weights run by
transformers on the chunk tokens ALONE at positions `OFFSET .. OFFSET + n - 1`. The stored K,
rotated by +OFFSET (delta-RoPE, the way a load places a chunk at a new offset), must equal
transformers' K there, and the stored V must equal transformers' V unshifted.
"""

from __future__ import annotations

import pytest
import torch
from blend_helpers import HEAD_SIZE, NUM_LAYERS, read_blocks, run

from ucm.eval.datasets import generate_synthetic
from ucm.integration.vllm.connector.ucm_connector import store_namespace
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.sparse.blend.hashing import BlockHasher
from ucm.sparse.blend.rope import rotate_keys
from ucm.store import UcmNfsStore
from ucm.store.keys import KeyKind, store_key

MARKER = 2  # <|im_end|>, the fixture's chunk_end_token_id
BLOCK = 128
CHUNK_TOKENS = 300  # two full blocks and a 44-token tail
OFFSET = 1000
LAYERS = (0, 1, 15, 29)

# Relative error = max |a - b| / max |b| over one layer's [tokens, heads, head_size] (fp32).
# Measured here (layers 0, 1, 15, 29): at offset 0, stored K and V against transformers
# 6e-7 .. 6e-6; at offset 1000, shifted K 8e-6 .. 2e-5 (rotate_keys and the worker's fused
# kernel give the same), V 5e-7 .. 2e-5, unshifted K 0.7 .. 1.0. Sources: vLLM's cos/sin cache
# and transformers' cos/sin round differently (rotating transformers' own offset-0 K by +1000
# alone gives ~1e-5), and vLLM's CPU kernels (attention, RMSNorm, matmuls) drift from
# transformers' path with depth. 1e-3 leaves a ~50x margin for other CPUs and thread counts,
# while a missing or wrong shift (even by one position: the fastest RoPE pair turns by 1 rad
# per position) gives errors of order 1 (asserted below for no shift).
REL_TOL = 1e-3
# Without the shift the keys are rotated by the wrong angle: far outside the tolerance.
UNSHIFTED_MIN_REL = 0.1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def chunk_tokens(tok) -> list[int]:
    ex = generate_synthetic(num_examples=1, passages_per_example=3, passage_words=200, seed=301)[0]
    passage = tok.encode(" ".join(ex.passages), add_special_tokens=False)[: CHUNK_TOKENS - 1]
    assert len(passage) == CHUNK_TOKENS - 1 and MARKER not in passage
    return passage + [MARKER]


def vllm_block_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's own prefix-cache hashes of the full blocks (sha256, the engine's default)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    parent, out = None, []
    for i in range(len(tokens) // BLOCK):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        out.append(bytes(parent))
    return out


def transformers_kv(model_dir, tokens: list[int], offsets: tuple[int, ...]) -> dict[int, list[tuple]]:
    """Per offset, per layer: (K, V) as [tokens, kv_heads, head_size], K with RoPE applied."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    out = {}
    with torch.no_grad():
        for offset in offsets:
            positions = torch.arange(offset, offset + len(tokens))[None]
            cache = model(input_ids=ids, position_ids=positions, use_cache=True).past_key_values
            assert len(cache.layers) == NUM_LAYERS
            out[offset] = [(layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
                           for layer in cache.layers]
    return out


@pytest.fixture(scope="module")
def stored_chunk(blend_llm, store_dir):
    """(chunk tokens, stored KV [tokens, layers, 2, H, D], the engine's VllmConfig)."""
    tok = blend_llm.get_tokenizer()
    chunk = chunk_tokens(tok)
    suffix = tok.encode("\nQuestion: where was the writer born?\nAnswer:", add_special_tokens=False)
    prompt = chunk + suffix
    assert len(prompt) < 3 * BLOCK  # the prompt's full blocks are exactly the chunk's two
    report = run(blend_llm, prompt, max_tokens=1).report
    # One chunk of 3 blocks, new to the cache: nothing loaded, all 3 blocks dumped.
    assert report["chunk_blocks"] == 3 and report["chunk_hit_blocks"] == 0 and not report["blended"]
    assert report["external_prefix_tokens"] == 0 and report["dumped_blocks"] == 3

    vllm_config = blend_llm.llm_engine.vllm_config
    cache = vllm_config.cache_config
    assert (cache.block_size, cache.prefix_caching_hash_algo) == (BLOCK, "sha256")
    from vllm.v1.core import kv_cache_utils

    full = vllm_block_hashes(chunk)
    hashes = BlockHasher("sha256", BLOCK, kv_cache_utils.NONE_HASH).chunk_hashes(chunk)
    assert hashes[:2] == full  # a chunk at position 0 shares vLLM's prefix hashes
    namespace = store_namespace(vllm_config)
    keys = [store_key(namespace, KeyKind.EXACT, h) for h in hashes]
    store = UcmNfsStore({"storage_backends": str(store_dir)})
    try:
        kv = read_blocks(store, keys, [BLOCK, BLOCK, CHUNK_TOKENS - 2 * BLOCK])
        # The tail is exact KV: nothing was stored for it as chunk KV.
        assert store.lookup([store_key(namespace, KeyKind.CHUNK, hashes[2])]) == [False]
    finally:
        store.close()
    return chunk, kv, vllm_config


@pytest.fixture(scope="module")
def reference(stored_chunk, model_dir):
    chunk, _, _ = stored_chunk
    return transformers_kv(model_dir, chunk, (0, OFFSET))


@pytest.fixture(scope="module")
def cos_sin(stored_chunk):
    """vLLM's cos/sin cache for this model's RoPE (what the worker shifts stored keys with)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    _, _, vllm_config = stored_chunk
    rope_parameters = dict(vllm_config.model_config.hf_text_config.rope_parameters)
    assert rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HEAD_SIZE, max_position=8192, rope_parameters=rope_parameters, is_neox_style=True,
                        dtype=torch.float32)
    return rope.cos_sin_cache.float()


def test_stored_chunk_is_its_kv_at_chunk_local_positions(stored_chunk, reference):
    """Sanity of the setup: what the engine stored is the chunk's KV at positions 0 .. n-1."""
    _, kv, _ = stored_chunk
    errors = {}
    for layer in LAYERS:
        k0, v0 = reference[0][layer]
        errors[layer] = (rel_err(kv[:, layer, 0], k0), rel_err(kv[:, layer, 1], v0))
    print("relative errors per layer at offset 0 (K, V):", errors)
    assert all(k < REL_TOL and v < REL_TOL for k, v in errors.values()), errors


def test_shifted_chunk_kv_matches_chunk_computed_at_offset(stored_chunk, reference, cos_sin):
    _, kv, _ = stored_chunk
    delta = torch.full((kv.shape[0],), OFFSET, dtype=torch.long)
    errors = {}
    for layer in LAYERS:
        k_ref, v_ref = reference[OFFSET][layer]
        stored_k, stored_v = kv[:, layer, 0], kv[:, layer, 1]
        shifted = rotate_keys(stored_k, delta, cos_sin, is_neox_style=True)
        errors[layer] = (rel_err(shifted, k_ref), rel_err(stored_v, v_ref), rel_err(stored_k, k_ref))
        k_err, v_err, unshifted_err = errors[layer]
        assert k_err < REL_TOL, (layer, errors)
        assert v_err < REL_TOL, (layer, errors)  # V carries no position: loaded as stored
        assert unshifted_err > UNSHIFTED_MIN_REL, (layer, errors)  # the shift is what makes K match
    print("relative errors per layer (shifted K, V, unshifted K):", errors)


def test_worker_shift_matches_chunk_computed_at_offset(stored_chunk, reference):
    """The worker's own shift (vLLM's fused rotary kernel over all layers at once, as loads use it)."""
    _, kv, vllm_config = stored_chunk
    worker = WorkerSide(vllm_config, store=None, check_layer=1)
    delta = torch.full((kv.shape[0],), OFFSET, dtype=torch.long)
    staging = kv.clone()  # the fused in-place path: K rows of a [tokens, layers, 2, H, D] buffer
    worker.rotation.shift_(staging[:, :, 0], delta)
    assert torch.equal(staging[:, :, 1], kv[:, :, 1])  # V untouched
    shifted = staging[:, :, 0]  # [tokens, layers, H, D]
    errors = {layer: rel_err(shifted[:, layer], reference[OFFSET][layer][0]) for layer in LAYERS}
    print("relative errors per layer, worker shift:", errors)
    assert all(e < REL_TOL for e in errors.values()), errors
    for layer in LAYERS:
        assert rel_err(kv[:, layer, 0], reference[OFFSET][layer][0]) > UNSHIFTED_MIN_REL, layer
    # And back (the dump direction: K computed at OFFSET is stored at chunk-local positions);
    # two fp32 rotations: ~2e-7 measured on random keys.
    back = shifted.clone()
    worker.rotation.shift_(back, -delta)
    assert rel_err(back, kv[:, :, 0].contiguous()) < 1e-5
    # A bfloat16 cache: its keys rotated in float32 and rounded once, so within half a bfloat16 ulp
    # (2^-8 relative) of the exact rotation of the same bfloat16 keys; V untouched.
    staging16 = kv.to(torch.bfloat16)
    k16 = staging16[:, :, 0].float().reshape(kv.shape[0], -1, HEAD_SIZE)
    exact = rotate_keys(k16, delta, worker.rotation.cos_sin, is_neox_style=True).view_as(shifted)
    worker.rotation.shift_(staging16[:, :, 0], delta)
    assert torch.equal(staging16[:, :, 1], kv[:, :, 1].to(torch.bfloat16))
    assert ((staging16[:, :, 0].float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
