"""BlendFirstScheduler (opt-in, `--scheduler-cls`): a blend request that arrives while a long
prefill runs gets a step in which the prefill keeps one block, and both answer as they do alone."""

from blend_helpers import assert_same, params, prompts, result, run

from ucm.integration.vllm.connector.stats import ucm_counters
from ucm.integration.vllm.llm import ucm_transfer_config

SCHEDULER = "ucm.integration.vllm.connector.blend_first_scheduler.BlendFirstScheduler"


def test_a_blend_request_arriving_behind_a_running_prefill_gets_a_short_step(model_dir, tmp_path, engine_factory,
                                                                             plain_llm, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # beside the session's engines
    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(tmp_path, blend_ratio=0.15),
                         scheduler_cls=SCHEDULER, max_num_batched_tokens=1024, max_model_len=4096,
                         disable_log_stats=False)
    a, b = prompts(llm, seed=150)
    long_new = prompts(llm, seed=151, passages=8, words=200)[0]  # several steps at this budget
    assert len(long_new) > 2 * 1024
    run(llm, a)  # stores a's chunks
    alone = run(llm, b)
    assert alone.report["blended"]
    llm.reset_prefix_cache()

    engine = llm.llm_engine
    before = ucm_counters(llm.get_metrics())
    engine.add_request("long", {"prompt_token_ids": long_new}, params())
    outs = {o.request_id: o for o in engine.step() if o.finished}  # the long prefill is running now
    engine.add_request("blend", {"prompt_token_ids": b}, params())
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    counts = ucm_counters(llm.get_metrics())
    assert counts.get("blend_first_steps", 0) - before.get("blend_first_steps", 0) >= 1

    together = result(outs["blend"])
    assert together.report["blended"] and together.tokens == alone.tokens
    assert_same(result(outs["long"]), run(plain_llm, long_new), tol=2e-3)
