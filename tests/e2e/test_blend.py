"""Blend on the real vLLM engine (embedded model, float32) against full prefill.

Every test uses its own generated passages, so the store and vLLM's prefix cache hold nothing
for them before the test. The reference is a plain engine without the connector.
"""

from __future__ import annotations

import pytest
from blend_helpers import MARKER, assert_same, forget_local_prefix_cache, params, prompts, result, run

from ucm.config import KV_SHIFT_DEFAULT
from ucm.eval.datasets import generate_synthetic

# Every prompt opens with the same system-message chunk (one partial block), stored by whichever
# test runs first; a prompt's own passages are new to the cache.
SHARED_SYSTEM_BLOCKS = 1


def test_ratio_one_equals_full_prefill(blend_llm, plain_llm):
    a, b = prompts(blend_llm, seed=101)
    first = run(blend_llm, a)
    assert first.report["chunk_hit_blocks"] <= SHARED_SYSTEM_BLOCKS and first.report["dumped_blocks"] > 0
    blended = run(blend_llm, b, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 0.8 * len(b) - 60
    assert_same(blended, run(plain_llm, b))


@pytest.mark.parametrize("selection,chunk_start_tokens,kv_shift", [
    ("query", None, None), ("hkvd", None, None), ("oracle", None, None), ("key_l1", None, None),
    ("key_l2", None, None), ("chunk_start", None, None), ("query", 16, None), ("query", None, True),
    ("query", None, 0.5), ("query", None, False)])
def test_scattered_recompute_over_exact_kv_is_exact(blend_llm, plain_llm, selection, chunk_start_tokens, kv_shift):
    """Reloading a prompt's own KV at its own positions is exact, so recomputing any 30% of its
    tokens must reproduce full prefill: this checks the delta-RoPE round trip, the subset pass's
    KV writes and that the query probe pass (which writes the question's KV over the loaded KV
    first) leaves nothing behind; the chunk-mean KV shift (whole or a share) moves exact KV by
    nothing. Exact KV deviates nowhere, so the selection here is one run;
    the masking of scattered rows is checked against vLLM's kernel in
    tests/unit/integration/test_sparse_attention.py and by the mixed batch's decode rows. Neither
    vLLM's prefix cache (emptied) nor the store's exact prefix (`ucm_exact_prefix: false`) serves
    the second run: its chunks are loaded as chunk KV."""
    a, _ = prompts(blend_llm, seed=102)
    run(blend_llm, a)
    forget_local_prefix_cache(blend_llm)
    again = run(blend_llm, a, ratio=0.3, selection=selection, exact_prefix=False, chunk_start_tokens=chunk_start_tokens,
                kv_shift=kv_shift)
    assert again.report["blended"] and again.report["chunk_hit_blocks"] > 0
    assert again.report["selection"] == selection
    assert again.report["chunk_start_tokens"] == (chunk_start_tokens or (16 if selection == "chunk_start" else 0))
    assert again.report["kv_shift"] == (KV_SHIFT_DEFAULT if kv_shift is None else float(kv_shift))
    assert_same(again, run(plain_llm, a), tol=2e-3)


def test_a_shift_estimated_from_a_sample_is_exact_over_exact_kv_and_moves_stale_kv(blend_llm, plain_llm):
    """kv_shift_sample: evenly spaced rows of every chunk are recomputed within the ratio and alone
    estimate the shift. Over a prompt's own KV that moves nothing (full prefill comes back); over
    reordered chunks it is another estimate than the ranked rows' (another answer distribution)."""
    a, b = prompts(blend_llm, seed=119)
    run(blend_llm, a)
    forget_local_prefix_cache(blend_llm)
    again = run(blend_llm, a, ratio=0.3, exact_prefix=False, kv_shift=1.0, kv_shift_sample=0.05)
    assert again.report["blended"] and again.report["kv_shift_sample"] == 0.05
    assert_same(again, run(plain_llm, a), tol=2e-3)
    ranked = run(blend_llm, b, ratio=0.15, exact_prefix=False, kv_shift=1.0)
    forget_local_prefix_cache(blend_llm)
    sampled = run(blend_llm, b, ratio=0.15, exact_prefix=False, kv_shift=1.0, kv_shift_sample=0.05)
    assert ranked.report["blended"] and sampled.report["blended"]
    assert ranked.report["chunk_hit_tokens"] == sampled.report["chunk_hit_tokens"]
    assert ranked.logprobs != sampled.logprobs


@pytest.mark.parametrize("ends_in_chunk", [False, True])
def test_full_reuse_of_exact_kv_is_exact(blend_llm, plain_llm, ends_in_chunk):
    """Full reuse (ratio 0) computes no loaded row, not even before the check layer: the question
    attends to the loaded KV of every layer, layer 0 included. Over a prompt's own KV that must
    reproduce full prefill. A prompt that ends inside a loaded chunk still computes its last row."""
    a, _ = prompts(blend_llm, seed=108)
    if ends_in_chunk:  # the system chunk and two passages, no question: the last row is loaded
        ends = [i for i, t in enumerate(a) if t == MARKER]
        a = a[:ends[2] + 1]
    run(blend_llm, a)
    forget_local_prefix_cache(blend_llm)
    again = run(blend_llm, a, ratio=0.0, exact_prefix=False)
    assert again.report["blended"] and again.report["chunk_hit_tokens"] > 0.5 * len(a)
    assert_same(again, run(plain_llm, a), tol=2e-3)


def test_full_reuse_differs_and_is_faster_path(blend_llm, plain_llm):
    """Full reuse recomputes no loaded token, so the default kv_shift has no estimate to move the
    reused KV by: the counter of moved tokens stays put (it moves once a ratio recomputes some)."""
    from ucm.integration.vllm.connector.stats import ucm_counters

    def shifted():
        return ucm_counters().get("kv_shifted_tokens", 0)

    a, b = prompts(blend_llm, seed=103)
    run(blend_llm, a)
    before = shifted()
    reuse = run(blend_llm, b, ratio=0.0)
    assert reuse.report["blended"] and reuse.report["kv_shift"] == KV_SHIFT_DEFAULT
    assert shifted() == before
    forget_local_prefix_cache(blend_llm)
    assert run(blend_llm, b, ratio=0.15).report["blended"]
    assert shifted() > before
    full = run(plain_llm, b)
    differs = reuse.tokens != full.tokens or any(
        abs(x - y) > 1e-3 for x, y in zip(reuse.logprobs, full.logprobs))
    assert differs, "full reuse (ratio 0) should not reproduce full prefill exactly"


def test_oracle_ranks_after_a_full_prefill_and_puts_the_loaded_kv_back(blend_llm, plain_llm):
    """The diagnostic "oracle" selection first runs the whole prompt as full prefill (counted as
    probe tokens) to rank the loaded tokens, then must restore their loaded KV: left in the cache,
    the exact KV of the 85% it does not recompute would make it reproduce full prefill."""
    from ucm.integration.vllm.connector.stats import ucm_counters

    a, b = prompts(blend_llm, seed=112)
    run(blend_llm, a)
    before = ucm_counters().get("probe_tokens", 0)
    oracle = run(blend_llm, b, ratio=0.15, selection="oracle")
    probed = ucm_counters()["probe_tokens"] - before
    assert oracle.report["blended"] and oracle.report["selection"] == "oracle"
    assert 0.9 * len(b) <= probed <= len(b)
    full = run(plain_llm, b)
    assert oracle.tokens != full.tokens or any(abs(x - y) > 1e-3 for x, y in zip(oracle.logprobs, full.logprobs))


def test_reordered_chunks_hit_the_cache(blend_llm):
    a, b = prompts(blend_llm, seed=104)
    first = run(blend_llm, a)
    second = run(blend_llm, b)
    assert first.report["chunk_hit_blocks"] <= SHARED_SYSTEM_BLOCKS
    assert second.report["chunk_hit_blocks"] == second.report["chunk_blocks"]  # every chunk block stored
    assert second.report["ratio"] == pytest.approx(0.15)


@pytest.mark.parametrize("case", ["no_marker", "shorter_than_block", "empty_chunks", "marker_last"])
def test_edge_prompts_equal_blend_off(blend_llm, plain_llm, case):
    tok = blend_llm.get_tokenizer()
    text = tok.encode(f"Case {case}: a short note about the weather in Orvale, which was sunny.",
                      add_special_tokens=False)
    token_ids = {
        "no_marker": text * 3,
        "shorter_than_block": text[:20] + [MARKER] + text[:10],
        "empty_chunks": text + [MARKER, MARKER, MARKER] + text,
        "marker_last": text + [MARKER] + text + [MARKER],
    }[case]
    assert_same(run(blend_llm, token_ids), run(plain_llm, token_ids))


def test_plain_request_after_blend_gets_exact_output(blend_llm, plain_llm):
    """Blended blocks must never be served as exact prefix by vLLM's cache or the store."""
    a, b = prompts(blend_llm, seed=105)
    run(blend_llm, a)
    assert run(blend_llm, b).report["blended"]
    plain = run(blend_llm, b, disable=True)
    assert not plain.report["blended"]
    assert_same(plain, run(plain_llm, b))


def test_mixed_batch_matches_requests_alone(blend_llm, plain_llm):
    """A step holding a blend prefill, a plain prefill and a decode gives each its own output.

    The blend request reloads its own KV at its own positions (exact), so any selection, query
    probe included, must give full prefill's output while the other requests share the step."""
    a, _ = prompts(blend_llm, seed=106)
    run(blend_llm, a)
    forget_local_prefix_cache(blend_llm)
    other, _ = prompts(blend_llm, seed=107, passages=2, words=80)
    decoding, _ = prompts(blend_llm, seed=108, passages=1, words=40)
    engine = blend_llm.llm_engine
    engine.add_request("decode", {"prompt_token_ids": decoding}, params(max_tokens=24, disable=True))
    outputs = {}
    engine.step()  # the decode request's prefill; from now on it decodes
    engine.add_request("blend", {"prompt_token_ids": a}, params(ratio=0.3, exact_prefix=False))
    engine.add_request("plain", {"prompt_token_ids": other}, params(disable=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = result(out)
    assert outputs["blend"].report["blended"]
    assert_same(outputs["blend"], run(plain_llm, a), tol=2e-3)
    assert_same(outputs["plain"], run(plain_llm, other))
    assert_same(outputs["decode"], run(plain_llm, decoding, max_tokens=24))


def _passage_chunks(llm, seed: int, passages: int = 3, words: int = 200):
    """Token ids of a generated question's passages (one chunk each, no marker) and its question."""
    tok = llm.get_tokenizer()
    ex = generate_synthetic(num_examples=1, passages_per_example=passages, passage_words=words, seed=seed)[0]
    chunks = [tok.encode(p + "\n\n", add_special_tokens=False) for p in ex.passages]
    return chunks, tok.encode("Question: " + ex.question + "\nAnswer:", add_special_tokens=False)


def _ask(llm, pieces: list[list[int]], question: list[int], **kw):
    """Sends the pieces (each a chunk, boundaries in ucm_chunk_lengths) and the question."""
    ids = [t for piece in pieces for t in piece] + question
    sp = params(**kw)
    sp.extra_args = sp.extra_args or {"kv_transfer_params": {}}
    sp.extra_args["kv_transfer_params"]["ucm_chunk_lengths"] = [len(piece) for piece in pieces]
    return result(llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]), ids


def test_chunk_lengths_per_request_need_no_marker(blend_llm, plain_llm):
    """Chunk boundaries given in kv_transfer_params: prompts without any marker token reuse chunks."""
    chunks, question = _passage_chunks(blend_llm, seed=109)
    _ask(blend_llm, chunks, question, ratio=0.15)
    blended, ids = _ask(blend_llm, [chunks[i] for i in (2, 0, 1)], question, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_blocks"] == blended.report["chunk_blocks"]
    assert_same(blended, run(plain_llm, ids))


def test_misses_between_loaded_chunks_keep_the_probes_kv(blend_llm, plain_llm):
    """Rows without loaded KV run the later layers once, in the question probe, and keep the KV
    they wrote there; only the question runs again. Here the prompt's own KV is loaded (exact)
    and one passage is split in two, so its second half hashes from a new chunk start and misses
    between loaded chunks: computed over exact KV, its probe KV is exact, and so is the answer."""
    from ucm.integration.vllm.connector.stats import ucm_counters

    chunks, question = _passage_chunks(blend_llm, seed=112, passages=4, words=400)
    _ask(blend_llm, chunks, question)
    forget_local_prefix_cache(blend_llm)
    bs = blend_llm.llm_engine.vllm_config.cache_config.block_size
    half = len(chunks[2]) // 2 // bs * bs
    assert half > 0 and len(chunks[2]) - half > bs, "the split passage must keep a whole loaded block and miss one"
    pieces = chunks[:2] + [chunks[2][:half], chunks[2][half:]] + chunks[3:]
    before = ucm_counters().get("probe_tokens", 0)
    blended, ids = _ask(blend_llm, pieces, question, ratio=0.3, exact_prefix=False)
    probed = ucm_counters()["probe_tokens"] - before
    report = blended.report
    assert report["blended"] and report["selection"] == "query" and report["fallback"] is None
    assert 0 < report["chunk_hit_blocks"] < report["chunk_blocks"]
    assert probed >= len(chunks[2]) - half + len(question)  # the misses went through the probe
    assert_same(blended, run(plain_llm, ids), tol=2e-3)


def test_prompt_longer_than_the_step_budget_blends(blend_llm, plain_llm):
    """Longer than max_num_batched_tokens (4096, chunked prefill on): the loaded region is reported
    to vLLM as computed, so only the last token is scheduled and the prompt blends in one step. At
    ratio 1.0 that is full prefill (same tokens and logprobs as the plain engine's chunked one)."""
    a, b = prompts(blend_llm, seed=110, passages=8, words=420)
    budget = blend_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert len(b) > budget
    run(blend_llm, a)
    blended = run(blend_llm, b)
    assert blended.report["blended"] and blended.report["fallback"] is None
    assert blended.report["blend_region_tokens"] > budget
    assert blended.report["chunk_hit_tokens"] > 0.9 * blended.report["blend_region_tokens"]
    exact = run(blend_llm, b, ratio=1.0)  # blended blocks never serve another request: blends again
    assert exact.report["blended"]
    assert_same(exact, run(plain_llm, b))


def test_concurrent_blend_requests_all_blend(blend_llm):
    """Four blend requests scheduled together (one step holds all four regions) all blend and
    answer as each does alone. (A prompt longer than the budget: the test above.)"""
    pairs = [prompts(blend_llm, seed=130 + i, passages=6, words=200) for i in range(4)]
    for a, _ in pairs:
        run(blend_llm, a)
    alone = [run(blend_llm, b) for _, b in pairs]
    outs = blend_llm.generate([{"prompt_token_ids": b} for _, b in pairs], params(), use_tqdm=False)
    together = [result(o) for o in outs]
    assert all(r.report["blended"] for r in alone + together)
    assert [r.tokens[:4] for r in together] == [r.tokens[:4] for r in alone]


def test_blend_disabled_request_still_stores_its_chunks(blend_llm):
    a, b = prompts(blend_llm, seed=111)
    first = run(blend_llm, a, disable=True)
    assert not first.report["blended"] and first.report["dumped_blocks"] > 0
    assert run(blend_llm, b).report["chunk_hit_blocks"] == first.report["chunk_blocks"]


def test_statistics_counters_follow_the_requests(blend_llm):
    """The connector's counters reach vLLM's metrics (KVConnectorStats -> Prometheus) per request."""
    from ucm.integration.vllm.connector.stats import ucm_counters

    def delta(before, after):
        return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

    a, b = prompts(blend_llm, seed=110)
    c0 = ucm_counters()
    first = run(blend_llm, a)
    c1 = ucm_counters()
    second = run(blend_llm, b, ratio=0.25)
    c2 = ucm_counters()

    d = delta(c0, c1)
    assert d["requests"] == 1 and d["prompt_tokens"] == len(a)
    assert d["dumped_blocks"] == first.report["dumped_blocks"] and d["dump_bytes"] > 0
    d = delta(c1, c2)
    assert d["requests"] == 1 and d["blended_requests"] == 1
    assert d["chunk_hit_tokens"] == second.report["chunk_hit_tokens"]
    # a's later chunks are found as references into a's exact blocks: one or two stored blocks each
    hits, refs = second.report["chunk_hit_blocks"], d.get("chunk_ref_hit_blocks", 0)
    assert refs > 0 and hits <= d["loaded_blocks"] <= hits + refs and "failed_blocks" not in d
    assert 0 < d["shared_reads"] < refs  # neighbouring chunk blocks name one exact block: read once
    loaded = d["recomputed_tokens"] + d["reused_tokens"]
    assert loaded == second.report["chunk_hit_tokens"]
    assert d["recomputed_tokens"] == pytest.approx(0.25 * loaded, abs=1)
    # rows beside vLLM's: the recomputed ones, the question and misses; never over the cap
    assert d["blend_rows"] >= d["recomputed_tokens"] + 1 and "blend_steps_over_cap" not in d
    question = len(b) - second.report["chunk_hit_tokens"] - second.report["external_prefix_tokens"]
    assert 0 < d["probe_tokens"] <= question  # the query selection ran the question rows once more
    cfg = blend_llm.llm_engine.model_config
    bytes_per_token = cfg.hf_text_config.num_hidden_layers * 2 * cfg.get_total_num_kv_heads() * cfg.get_head_size() * 4
    assert d["load_bytes"] >= loaded * bytes_per_token and 0 < d["load_wait_seconds"] <= d["load_seconds"]
    # vLLM's cached tokens are the KV served and kept: the prefixes and the reused chunk tokens,
    # not the misses, the question or the recomputed rows of the Blend region.
    assert second.cached_tokens == pytest.approx(
        d.get("local_prefix_tokens", 0) + second.report["external_prefix_tokens"] + d["reused_tokens"], abs=1)
    assert first.cached_tokens == (c1.get("local_prefix_tokens", 0) - c0.get("local_prefix_tokens", 0)
                                   + first.report["external_prefix_tokens"])


def test_preempted_blend_request_answers_as_unpreempted(model_dir, tmp_path, engine_factory):
    """A KV cache of 16 blocks holds two ~900-token prompts but not their 200-token answers:
    vLLM preempts the second request mid-answer. Readmitted, it reloads its chunk KV and blends
    again (its blended blocks in vLLM's cache are never matched), so it answers as it does alone."""
    from vllm import SamplingParams

    from ucm.integration.vllm.llm import ucm_transfer_config

    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(tmp_path, blend_ratio=0.15),
                         max_model_len=2048, num_gpu_blocks_override=17, disable_log_stats=False)
    assert llm.llm_engine.vllm_config.cache_config.block_size * 16 < 2 * (900 + 200)
    sp = SamplingParams(max_tokens=200, temperature=0.0, logprobs=0, ignore_eos=True)
    pairs = [prompts(llm, seed=140 + i, passages=4, words=150) for i in range(2)]
    llm.generate([{"prompt_token_ids": a} for a, _ in pairs], sp, use_tqdm=False)  # stores the chunks
    alone = []
    for _, b in pairs:
        llm.reset_prefix_cache()
        alone.append(result(llm.generate([{"prompt_token_ids": b}], sp, use_tqdm=False)[0]))
    llm.reset_prefix_cache()
    together = [result(o) for o in llm.generate([{"prompt_token_ids": b} for _, b in pairs], sp, use_tqdm=False)]
    assert [r.report["preemptions"] for r in alone] == [0, 0]
    assert sum(r.report["preemptions"] for r in together) >= 1
    for r in alone + together:
        assert r.report["blended"] and r.report["fallback"] is None
    assert [r.tokens for r in together] == [r.tokens for r in alone]
