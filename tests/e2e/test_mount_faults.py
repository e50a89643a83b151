"""A Blend engine whose store is a mount that stops answering reads (tests/fault_mount.py: a FUSE
passthrough, what an NFS client with cached attributes shows: stats answered, opens and reads
hung). The request that first meets the hang pays one load timeout and is computed; while the
reads stay hung the next ones are computed at once (the store counts as down on the worker and
on the scheduler); after release blending resumes within the back-off. Every answer equals plain
vLLM's. Skipped where FUSE cannot mount."""

from __future__ import annotations

import time

import pytest
from blend_helpers import STORE_ALL, assert_same, forget_local_prefix_cache, prompts, run, wait_until_stable
from fault_mount import FaultMount, mounted_or_skip

from ucm.integration.vllm.connector.stats import ucm_counters

pytestmark = pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")

LOAD_TIMEOUT_S, LOOKUP_TIMEOUT_S, BACKOFF_S, BACKOFF_MAX_S = 8.0, 4.0, 2.0, 4.0
TOL = 2e-3  # computed by vLLM after a failed load, in a batch shape of its own (test_trust.py)


def test_a_mount_whose_reads_hang_costs_one_timeout_then_blending_resumes(engine_factory, model_dir, plain_llm,
                                                                          tmp_path):
    from ucm.integration.vllm.llm import ucm_transfer_config

    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as mount:
        store = {"load_timeout_s": LOAD_TIMEOUT_S, "load_min_mb_s": 0, "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                 "dump_timeout_s": 10.0, "down_backoff_s": BACKOFF_S, "down_backoff_max_s": BACKOFF_MAX_S}
        llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(
            mount.mountpoint, blend_ratio=0.15, blend_options=STORE_ALL, store_options=store), disable_log_stats=False)
        questions = [prompts(llm, seed=900 + i) for i in range(3)]
        for first, _ in questions:
            run(llm, first)  # its chunks stored on the mount
        wait_until_stable(tmp_path / "server")

        mount.set(hang=["open", "read"])
        timed = []
        for _, reordered in questions[:2]:
            forget_local_prefix_cache(llm)
            t0 = time.monotonic()
            got = run(llm, reordered)
            timed.append((time.monotonic() - t0, got))
            assert not got.report["blended"], got.report
            assert_same(got, run(plain_llm, reordered), tol=TOL)
        # The first pays one deadline: the scheduler's read of the chunk references (lookup_timeout_s)
        # or, where it planned loads, the worker's (load_timeout_s); the second none.
        (first_s, first), (second_s, second) = timed
        assert first_s >= LOOKUP_TIMEOUT_S and second_s < LOOKUP_TIMEOUT_S, (first_s, second_s, first.report)
        assert ucm_counters(llm.get_metrics()).get("store_down_blocks", 0) > 0

        mount.set()
        time.sleep(BACKOFF_MAX_S + 1)  # the timed-out reads return at once; the back-off ends
        forget_local_prefix_cache(llm)
        _, reordered = questions[2]
        again = run(llm, reordered)
        if not again.report["blended"]:  # the scheduler may hold the store down one back-off longer
            time.sleep(BACKOFF_MAX_S)
            forget_local_prefix_cache(llm)
            again = run(llm, reordered)
        assert again.report["blended"] and again.report["fallback"] is None, again.report


@pytest.mark.parametrize("setting", [True, "auto"])
def test_a_request_whose_prefix_read_hangs_does_not_hold_the_others(engine_factory, model_dir, plain_llm, tmp_path,
                                                                    setting):
    """Exact-prefix loads complete between steps (async_prefix_loads true, or "auto" once a read
    inside a step was slow): while one request's read hangs on the mount, a request that arrived
    with it is prefilled and answered; after release the first is answered from its loaded
    prefix. Every answer as plain vLLM's."""
    from blend_helpers import params, result
    from ucm.integration.vllm.llm import ucm_transfer_config

    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as mount:
        # The read hangs until released: no deadline shorter than the test's (load_min_mb_s 0).
        store = {"load_timeout_s": 120.0, "load_min_mb_s": 0, "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                 "dump_timeout_s": 120.0}
        llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(mount.mountpoint, store_options=store,
                                                                               async_prefix_loads=setting),
                             disable_log_stats=False)
        cached, _ = prompts(llm, seed=950)
        new, _ = prompts(llm, seed=951)
        warm, _ = prompts(llm, seed=952)
        for token_ids in (cached, warm):
            run(llm, token_ids)  # their blocks stored as exact KV
        wait_until_stable(tmp_path / "server")
        forget_local_prefix_cache(llm)
        if setting == "auto":  # a slow read inside a step: "auto" reads between steps from now on
            mount.set(latency_ms=100)
            assert_same(run(llm, warm), run(plain_llm, warm))
            mount.set()
            forget_local_prefix_cache(llm)

        mount.set(hang=["open", "read"])
        engine = llm.llm_engine
        engine.add_request("cached", {"prompt_token_ids": cached}, params())
        engine.add_request("new", {"prompt_token_ids": new}, params())
        outs, deadline = {}, time.monotonic() + 120
        while "new" not in outs:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
            assert time.monotonic() < deadline, "the request without stored KV waited for the hung read"
        assert "cached" not in outs  # still waiting for its read
        mount.set()
        while "cached" not in outs:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
            assert time.monotonic() < deadline
        got = result(outs["cached"])
        assert got.report["external_prefix_tokens"] > 0, got.report
        assert_same(got, run(plain_llm, cached))
        assert_same(result(outs["new"]), run(plain_llm, new))
        assert ucm_counters(llm.get_metrics()).get("background_loads", 0) >= 1
