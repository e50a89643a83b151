"""Plans made off the scheduler's step (async_lookups), on a real store directory and the real
scheduler half: a new request whose lookups would hold others' steps waits in the queue while its
plan is made on the planner's thread, and is then admitted with the plan a step-time lookup gives.
An idle engine plans in its step; "auto" moves plans off the step only after slow lookups."""

from __future__ import annotations

import time

import pytest

from fault_mount import FaultMount
from test_scheduler_side import admit, prompt, request, side_for, step, store_chunks
from ucm.integration.vllm.connector import background_plans
from ucm.integration.vllm.connector.background_plans import BackgroundPlans
from ucm.integration.vllm.connector.request_params import REPORT_KEY
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.faults import FAULTS_ENV


def planned(side, req, num_computed=0, seconds=10.0):
    """vLLM's question, asked every step until the plan made off the step is there."""
    deadline = time.monotonic() + seconds
    while (answer := side.get_num_new_matched_tokens(req, num_computed)) == (None, False):
        assert time.monotonic() < deadline, "the plan was never made"
        time.sleep(0.01)
    return answer


def running(side, seed=9):
    """Another request, admitted: the engine is busy."""
    other = request(side, "other", prompt(seed))
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    admit(side, other, 0)
    return other


def test_a_new_request_is_planned_off_the_step_while_another_runs(tmp_path):
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    running(side)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # its plan is being made
    assert planned(side, req) == (21, False)  # what a plan in the step gives (below)
    assert side.stats.data["background_plans"] == 1
    meta, _ = step(side, [admit(side, req, 21)], {"a": 1})
    assert any(s.req_id == "a" and s.blend is not None for s in meta.requests)

    idle = side_for(tmp_path / "idle")
    store_chunks(idle, tokens)
    assert idle.get_num_new_matched_tokens(request(idle, "a", tokens), 0) == (21, False)


def test_an_idle_engine_plans_in_its_step(tmp_path):
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    assert side.get_num_new_matched_tokens(request(side, "a", tokens), 0) == (21, False)
    assert "background_plans" not in side.stats.data


def test_a_plan_made_for_another_prefix_hit_or_too_old_is_made_again(tmp_path, monkeypatch):
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    running(side)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.5)
    assert side.get_num_new_matched_tokens(req, 4) == (None, False)  # vLLM's local hit changed: planned again
    assert planned(side, req, 4)[0] is not None
    assert side.stats.data["background_plans"] == 2
    monkeypatch.setattr("ucm.integration.vllm.connector.scheduler_side.HELD_PLAN_SECONDS", 0.0)
    side.request_finished(req)
    req = request(side, "b", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.5)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # made, but stale when asked: again
    assert side.stats.data["background_plans"] == 4


def test_a_request_finished_while_its_plan_is_made_leaves_nothing(tmp_path):
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    running(side)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.request_finished(req) is None  # never admitted: no report
    assert not side.plans._jobs
    assert planned(side, request(side, "a", tokens)) == (21, False)  # the id again: a plan of its own


def test_a_plan_that_raises_off_the_step_leaves_the_request_to_vllm(tmp_path, monkeypatch):
    faults = tmp_path / "faults"
    faults.write_text("lookup")
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    faults.write_text("")
    running(side)
    faults.write_text("lookup")
    req = request(side, "a", tokens)
    assert planned(side, req) == (0, False)  # computed by vLLM
    assert side.stats.data["lookup_errors"] == 1
    assert side.request_finished(req)[REPORT_KEY]["fallback"] == "blend_error"


def test_auto_moves_plans_off_the_step_after_slow_lookups_for_a_while(monkeypatch):
    asked = [0.0]
    plans = BackgroundPlans("auto", lambda: asked[0], UCMConnectorStats())

    def plan(seconds):
        asked[0] += seconds
        return "state"

    assert plans.now(lambda: plan(0.001)) == "state" and not plans.wanted()
    assert not plans.off_step("a", True)  # fast lookups: in the step
    assert plans.now(lambda: plan(background_plans.SLOW_LOOKUPS_S * 2)) == "state" and plans.wanted()
    assert not plans.off_step("a", False)  # nobody else runs: in the step
    assert plans.off_step("a", True)
    assert plans.later("a", 0, lambda: plan(0.001), 2.0) is None  # started
    assert plans.off_step("a", False)  # in flight: waited for
    deadline = time.monotonic() + 10
    while (state := plans.later("a", 0, lambda: plan(0.001), 2.0)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert state == "state" and not plans.off_step("a", False)
    plans.slow_until = time.monotonic() - 1  # the hold ran out
    assert not plans.wanted()
    plans.close()


@pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")
def test_slow_lookups_on_a_mount_move_the_next_plans_off_the_step(tmp_path):
    with FaultMount(tmp_path / "src", tmp_path / "mnt") as mount:
        side = side_for(tmp_path / "mnt", async_lookups="auto")
        tokens = prompt(1)
        store_chunks(side, tokens)
        running(side)
        mount.set(latency_ms=30)
        first = side.get_num_new_matched_tokens(request(side, "a", tokens), 0)
        assert first == (21, False) and side.plans.wanted()  # planned in the step, and found slow
        assert side.get_num_new_matched_tokens(request(side, "b", tokens), 0) == (None, False)
        assert planned(side, request(side, "b", tokens)) == (21, False)
        mount.set()
        side.store.close()


def test_a_plan_ahead_of_vllms_question_is_made_off_the_step_too(tmp_path):
    side = side_for(tmp_path, async_lookups=True)
    tokens = prompt(1)
    store_chunks(side, tokens)
    running(side)
    req = request(side, "a", tokens)
    assert side.planned_blend_work(req) == 0  # BlendFirstScheduler's look-ahead: being made
    deadline = time.monotonic() + 10
    while not (work := side.planned_blend_work(req)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert work > 0 and side.stats.data["background_plans"] == 1
    assert side.get_num_new_matched_tokens(req, 0) == (21, False)  # the look-ahead's plan, held for it
    assert side.stats.data["background_plans"] == 1
