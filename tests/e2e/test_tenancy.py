"""Chunk KV between tenants on a real engine.

A tenant (`cache_salt`) never loads another tenant's chunk KV, as vLLM's prefix cache never
serves another tenant's prefix; under the "alone" chunk-store policy no user's text shapes the
chunk KV that others reuse: a chunk is stored only as computed with nothing before it (the engine
computes the chunks a request missed alone while it is idle).
"""

from __future__ import annotations

import time

from blend_helpers import MARKER, assert_same, forget_local_prefix_cache, prompts, read_blocks, run

from ucm.eval.datasets import generate_synthetic
from ucm.integration.vllm.llm import ucm_transfer_config
from ucm.integration.vllm.connector.ucm_connector import store_namespace
from ucm.sparse.blend.hashing import BlockHasher, IsolationKeys
from ucm.store import UcmNfsStore
from ucm.store.keys import KeyKind, store_key


def test_two_tenants_do_not_share_chunk_kv_one_tenant_does(blend_llm):
    a, b = prompts(blend_llm, seed=501)
    run(blend_llm, a, cache_salt="tenant-a")
    other = run(blend_llm, b, cache_salt="tenant-b")
    assert other.report["chunk_hit_blocks"] == 0 and not other.report["blended"]
    same = run(blend_llm, b, cache_salt="tenant-a")
    assert same.report["blended"] and same.report["chunk_hit_blocks"] == same.report["chunk_blocks"]


def texts(tok, seed, n):
    """n chunks of generated text, each closed by the marker, and a question suffix."""
    ex = generate_synthetic(num_examples=1, passages_per_example=n, passage_words=160, seed=seed)[0]
    chunks = [tok.encode(p, add_special_tokens=False) + [MARKER] for p in ex.passages]
    return chunks, tok.encode("\nQuestion: " + ex.question + "\nAnswer:", add_special_tokens=False)


def test_alone_policy_stores_chunks_only_as_computed_with_nothing_before_them(model_dir, tmp_path, engine_factory):
    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(tmp_path, blend_ratio=0.15,
                                                                           chunk_store="alone"))
    (junk, doc, junk2), question = texts(llm.get_tokenizer(), 502, 3)
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    config = llm.llm_engine.vllm_config
    bs = config.cache_config.block_size
    hasher = BlockHasher("sha256", bs, kv_cache_utils.NONE_HASH)
    sizes = [min(bs, len(doc) - i) for i in range(0, len(doc), bs)]
    store = UcmNfsStore({"storage_backends": str(tmp_path)})

    def doc_keys(salt):
        return [store_key(store_namespace(config), KeyKind.EXACT, h)
                for h in hasher.chunk_hashes(doc, IsolationKeys(None, salt))]

    try:
        # Text of the sender's choosing before the document: its KV there is not stored; once the
        # engine is idle it computes the document alone (background_chunks) and stores that.
        first = run(llm, junk + doc + question, cache_salt="tenant-a")
        assert first.report["chunk_hit_blocks"] == 0
        deadline = time.monotonic() + 120
        while not all(store.lookup(doc_keys("tenant-a"))):
            assert time.monotonic() < deadline, "the document was not computed alone in the background"
            time.sleep(0.5)
        again = run(llm, junk2 + doc + question, cache_salt="tenant-a")
        assert again.report["blended"] and again.report["chunk_hit_tokens"] == len(doc)
        # What is stored is the document's KV alone: the same as an indexing request's (the document
        # sent by itself) for a tenant that never saw the junk.
        run(llm, doc, cache_salt="tenant-b", max_tokens=1)
        stored = [read_blocks(store, doc_keys(salt), sizes) for salt in ("tenant-a", "tenant-b")]
    finally:
        store.close()
    assert float((stored[0] - stored[1]).abs().max()) <= 1e-6


def test_lora_adapter_blends_only_its_own_chunk_kv(model_dir, tmp_path, engine_factory):
    """KV computed under another adapter (here the base model) is never loaded; the adapter's own
    chunk KV is, and blending it at ratio 1.0 answers as the adapter's full prefill: every row the
    Blend forward runs (region rows, probe and subset passes) gets the request's adapter."""
    from lora_adapter import write_random_adapter
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("random", 1, str(write_random_adapter(model_dir, tmp_path / "adapter")))
    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(tmp_path / "store", blend_ratio=0.15),
                         enable_lora=True, max_lora_rank=8, max_loras=1)
    a, b = prompts(llm, seed=503)
    run(llm, a)  # the base model's chunk KV
    cold = run(llm, b, lora_request=lora)
    assert cold.report["chunk_hit_blocks"] == 0 and not cold.report["blended"]
    run(llm, a, lora_request=lora)  # the adapter's own (b's are stored too, by the run above)
    forget_local_prefix_cache(llm)
    blended = run(llm, b, lora_request=lora, ratio=1.0, exact_prefix=False)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 0.8 * len(b) - 60
    forget_local_prefix_cache(llm)
    full = run(llm, b, lora_request=lora, disable=True, exact_prefix=False)
    assert_same(blended, full)
    forget_local_prefix_cache(llm)
    base = run(llm, b, disable=True, exact_prefix=False)
    # The adapter matters: the match above is not the base model's answer matching itself.
    assert max(abs(x - y) for x, y in zip(base.logprobs, full.logprobs)) > 0.1
    forget_local_prefix_cache(llm)
    probed = run(llm, b, lora_request=lora, exact_prefix=False)  # ratio 0.15, the question probe's subset passes
    assert probed.report["blended"] and probed.report["fallback"] is None and probed.report["selection"] == "query"
