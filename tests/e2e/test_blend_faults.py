"""A fault in the cache path fails towards computing, on the session's Blend engine.

An error raised at any stage (the scheduler's lookup, the load, the RoPE shift of chunk keys,
the selection, the Blend forward after some layers wrote the cache, a layer's attention, the dump) is injected for
real in the engine's own processes (UCM_FAULTS, ucm/integration/vllm/faults.py). The engine
keeps serving; the request is answered as full prefill answers it, reports
`fallback: "blend_error"`, is counted, and nothing of it is stored; the next request blends.
"""

from __future__ import annotations

import pytest
from blend_helpers import assert_same, block_files, forget_local_prefix_cache, prompts, run, wait_until_stable

from ucm.integration.vllm.connector.stats import ucm_counters

# Recomputed by vLLM in a batch shape of its own (as after a failed load, test_trust.py).
TOL = 2e-3


def counts_of(llm, fn):
    before = ucm_counters(llm.get_metrics())
    out = fn()
    after = ucm_counters(llm.get_metrics())
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def with_faults(faults_file, stages: str, fn):
    faults_file.write_text(stages)
    try:
        return fn()
    finally:
        faults_file.write_text("")


@pytest.mark.parametrize("stage", ["lookup", "load", "rotate", "select", "forward", "attention"])
def test_a_fault_hands_the_request_to_vllm_and_stores_nothing(blend_llm, plain_llm, store_dir, faults_file, stage):
    seed = 700 + ["lookup", "load", "rotate", "select", "forward", "attention"].index(stage)
    first, reordered = prompts(blend_llm, seed=seed)
    run(blend_llm, first)  # stores its exact blocks and chunks
    wait_until_stable(store_dir)
    forget_local_prefix_cache(blend_llm)
    inodes = {p: p.stat().st_ino for p in block_files(store_dir)}

    got, counts = counts_of(blend_llm, lambda: with_faults(faults_file, stage, lambda: run(blend_llm, reordered)))
    assert got.report["fallback"] == "blend_error" and not got.report["blended"], got.report
    assert counts.get("blend_fallbacks_blend_error", 0) == 1, counts
    assert counts.get("lookup_errors" if stage == "lookup" else "blend_errors", 0) >= 1, counts
    assert_same(got, run(plain_llm, reordered), tol=TOL)
    wait_until_stable(store_dir)
    assert [p for p in block_files(store_dir) if inodes.get(p) != p.stat().st_ino] == []

    # The engine serves on, and blends the same prompt once the fault is gone.
    forget_local_prefix_cache(blend_llm)
    again = run(blend_llm, reordered)
    assert again.report["blended"] and again.report["fallback"] is None, again.report


def test_a_fault_in_the_dump_stores_nothing_of_the_step(blend_llm, plain_llm, store_dir, faults_file):
    prompt, _ = prompts(blend_llm, seed=720)
    wait_until_stable(store_dir)
    inodes = {p: p.stat().st_ino for p in block_files(store_dir)}
    got, counts = counts_of(blend_llm, lambda: with_faults(faults_file, "dump", lambda: run(blend_llm, prompt)))
    assert counts.get("dump_errors", 0) >= 1, counts
    assert_same(got, run(plain_llm, prompt), tol=TOL)
    wait_until_stable(store_dir)
    assert [p for p in block_files(store_dir) if inodes.get(p) != p.stat().st_ino] == []

    forget_local_prefix_cache(blend_llm)
    run(blend_llm, prompt)  # stored once the fault is gone
    wait_until_stable(store_dir)
    assert [p for p in block_files(store_dir) if inodes.get(p) != p.stat().st_ino]
