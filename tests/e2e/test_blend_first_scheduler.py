"""BlendFirstScheduler, the default with Blend on: a blend request that arrives while a long
prefill runs, behind a request that arrived before it, goes first, in a step where the other
prefills keep one token, and every request answers as it does alone."""

from blend_helpers import assert_same, params, prompts, result, run

from ucm.integration.vllm.connector.blend_first_scheduler import QUALNAME
from ucm.integration.vllm.connector.stats import ucm_counters
from ucm.integration.vllm.llm import engine_kwargs, ucm_transfer_config


def test_blend_turns_on_blend_first_unless_a_scheduler_is_given(model_dir, tmp_path):
    blend = ucm_transfer_config(tmp_path, blend_ratio=0.15)
    assert engine_kwargs(str(model_dir), kv_transfer_config=blend)["scheduler_cls"] == QUALNAME
    assert "scheduler_cls" not in engine_kwargs(str(model_dir), kv_transfer_config=ucm_transfer_config(tmp_path))
    assert "scheduler_cls" not in engine_kwargs(str(model_dir))
    mine = "vllm.v1.core.sched.scheduler.Scheduler"
    assert engine_kwargs(str(model_dir), kv_transfer_config=blend, scheduler_cls=mine)["scheduler_cls"] == mine


def test_a_blend_request_behind_a_running_prefill_and_a_waiting_one_goes_first(model_dir, tmp_path, engine_factory,
                                                                              plain_llm, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # beside the session's engines
    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(tmp_path, blend_ratio=0.15),
                         max_num_batched_tokens=1024, max_model_len=4096, disable_log_stats=False)
    a, b = prompts(llm, seed=150)
    long_new = prompts(llm, seed=151, passages=8, words=200)[0]  # several steps at this budget
    cold = prompts(llm, seed=152, passages=4, words=200)[0]  # nothing of it stored: no blend
    assert len(long_new) > 2 * 1024 and len(cold) > 1024
    run(llm, a)  # stores a's chunks
    alone = run(llm, b)
    assert alone.report["blended"]
    llm.reset_prefix_cache()

    engine = llm.llm_engine
    before = ucm_counters(llm.get_metrics())
    engine.add_request("long", {"prompt_token_ids": long_new}, params())
    outs = {o.request_id: o for o in engine.step() if o.finished}  # the long prefill is running now
    engine.add_request("cold", {"prompt_token_ids": cold}, params())
    engine.add_request("blend", {"prompt_token_ids": b}, params())
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    counts = ucm_counters(llm.get_metrics())
    assert counts.get("blend_first_steps", 0) - before.get("blend_first_steps", 0) >= 1
    assert counts.get("blend_first_reorders", 0) - before.get("blend_first_reorders", 0) == 1
    times = {name: out.metrics for name, out in outs.items()}  # engine core timestamps
    assert times["blend"].scheduled_ts <= times["cold"].scheduled_ts  # FCFS alone: cold a step earlier
    assert times["blend"].first_token_ts < min(times["cold"].first_token_ts, times["long"].first_token_ts)

    together = result(outs["blend"])
    assert together.report["blended"] and together.tokens == alone.tokens
    assert_same(result(outs["long"]), run(plain_llm, long_new), tol=2e-3)
    assert_same(result(outs["cold"]), run(plain_llm, cold), tol=2e-3)
