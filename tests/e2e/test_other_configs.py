"""The other implementations' configurations on the real engine: LMCache's special string between
chunks (`chunk_separator`, given as text and tokenized by the engine), check layer 1, ratio 0.15."""

from __future__ import annotations

import math

from blend_helpers import STORE_ALL, forget_local_prefix_cache, run

from ucm.eval.datasets import generate_synthetic

LMCACHE_SEPARATOR = " # # "


def test_lmcache_separator_string_marks_the_chunks(model_dir, tmp_path, engine_factory):
    """Prompts built as LMCache's examples build them: token ids of each passage with the special
    string's ids between them. Computed once, then asked with the passages in another order: every
    chunk block is found and the request blends."""
    from ucm.integration.vllm.llm import ucm_transfer_config

    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(
        tmp_path, blend_ratio=0.15, chunk_end_token_id=None,
        blend_options={"chunk_separator": LMCACHE_SEPARATOR, **STORE_ALL}))
    tok = llm.get_tokenizer()
    sep = tok.encode(LMCACHE_SEPARATOR, add_special_tokens=False)
    assert len(sep) > 1
    ex = generate_synthetic(num_examples=1, passages_per_example=3, passage_words=120, seed=331)[0]
    passages = [tok.encode(p, add_special_tokens=False) for p in ex.passages]
    question = tok.encode("Question: " + ex.question + "\nAnswer:", add_special_tokens=False)

    def prompt(order):
        ids = tok.encode("Answer from the passages.", add_special_tokens=False) + sep
        for i in order:
            ids += passages[i] + sep
        return ids + question

    first = run(llm, prompt([0, 1, 2]), max_tokens=4)
    assert not first.report["blended"] and first.report["chunk_blocks"] > 0
    forget_local_prefix_cache(llm)
    second = run(llm, prompt([2, 0, 1]), max_tokens=4)
    assert second.report["blended"], second.report
    assert second.report["chunk_hit_blocks"] == second.report["chunk_blocks"]


def test_gradual_filtering_narrows_the_selection_at_a_later_check_layer(model_dir, tmp_path, engine_factory,
                                                                        blend_llm):
    """CacheBlend's gradual filtering (check layers 1 and 4, ratios 0.5 and 0.15). A request at
    0.15 selects 0.15 at layer 1 and keeps all of it at layer 4: the same rows, so the same
    answer, as the one-layer engine at 0.15. At the config's 0.5 the selection narrows to 0.15
    of the loaded tokens at layer 4 (counted), and the request blends."""
    from blend_helpers import assert_same, prompts

    from ucm.integration.vllm.connector.stats import ucm_counters
    from ucm.integration.vllm.llm import ucm_transfer_config

    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(
        tmp_path, blend_ratio=0.5, blend_options=STORE_ALL, later_checks=[(4, 0.15)]), disable_log_stats=False)
    first, reordered = prompts(llm, seed=343)
    for engine in (llm, blend_llm):
        run(engine, first)
        forget_local_prefix_cache(engine)
    same = run(llm, reordered, ratio=0.15)
    assert same.report["blended"], same.report
    assert_same(same, run(blend_llm, reordered, ratio=0.15))
    assert ucm_counters(llm.get_metrics()).get("narrowed_tokens", 0) == 0
    forget_local_prefix_cache(llm)
    before = ucm_counters(llm.get_metrics())
    narrowed = run(llm, reordered)
    assert narrowed.report["blended"] and narrowed.report["ratio"] == 0.5, narrowed.report
    after = ucm_counters(llm.get_metrics())
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    loaded = delta["recomputed_tokens"] + delta["reused_tokens"]
    assert delta["recomputed_tokens"] == math.ceil(0.5 * loaded - 1e-6), delta
    # Of those, all but 0.15 of the loaded tokens stop at layer 4.
    assert delta["narrowed_tokens"] == delta["recomputed_tokens"] - math.ceil(0.15 * loaded - 1e-6), delta
