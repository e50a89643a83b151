"""Wrong KV never enters the shared store.

A Blend config on an engine whose model is not the Blend class is refused at start-up (vLLM's
own forward would leave every blended region uncomputed and the connector would store it). A
request whose loads fail (damaged block files, found by the lookup and refused by the load's
checksum, or exact blocks named by intact chunk references) is answered exactly as full prefill
answers it, reports `fallback: "load_failed"` and stores nothing (no KV, no reference), under a
batch of such requests; sent again, what they store passes the store
audit (recomputed by a reference engine: no wrong block). The same holds when the store stops
answering (loads past their deadline, a capacity ledger locked by another process), and the
engine neither stalls nor writes until it answers again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from blend_helpers import (STORE_ALL, assert_same, block_files, forget_local_prefix_cache, params, prompts, result, run,
                           wait_until_stable)

from ucm.integration.vllm.audit import audit_store
from ucm.integration.vllm.connector.stats import ucm_counters
from ucm.integration.vllm.llm import shutdown, ucm_transfer_config
from ucm.sparse.blend.chunk_refs import REF_BYTES
from ucm.store.block_format import HEADER_REGION
from ucm.store.usage_ledger import LEDGER_NAME


REF_FILE_LIMIT = HEADER_REGION + REF_BYTES  # a stored reference: header and record


def test_blend_config_without_the_blend_forward_is_refused_at_start_up(model_dir, tmp_path):
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(f"""
        from ucm.integration.vllm.llm import make_llm, ucm_transfer_config

        if __name__ == "__main__":
            make_llm({str(model_dir)!r}, kv_transfer_config=ucm_transfer_config({str(tmp_path / "store")!r},
                                                                               blend_ratio=0.15))
            print("ENGINE STARTED")
        """))
    env = dict(os.environ, UCM_BLEND_NO_MODELS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE STARTED" not in out
    assert "was not built with the Blend forward" in out and "UCM_BLEND_NO_MODELS" in out, out[-3000:]


def store_prompts(llm, store, seed: int) -> list[list[int]]:
    """Stores six prompts and returns them as a batch that loads them back: three sent again as they
    were (exact prefix loads), three reordered (their chunks found through references into the
    exact blocks their original order stored: chunk loads). No two share a stored block."""
    prefix_group = [prompts(llm, seed=s)[0] for s in range(seed, seed + 3)]
    chunk_group = [prompts(llm, seed=s) for s in range(seed + 3, seed + 6)]
    for prompt in prefix_group + [first for first, _ in chunk_group]:
        run(llm, prompt)  # stores each prompt's exact prefix and its chunks
    # A chunk reference is written a step after its exact blocks are confirmed: a few more steps
    # (a request with no chunk) write the last prompt's.
    llm.generate([{"prompt_token_ids": [10] * 20}], params(), use_tqdm=False)
    assert wait_until_stable(store) > 0
    forget_local_prefix_cache(llm)  # the prompts' prefixes now come from the store
    return prefix_group + [reordered for _, reordered in chunk_group]


def written_since(store, inodes: dict) -> list:
    """Block files written since `inodes` was taken: a block written later is a new file (renamed
    into place); reading a block only touches it (its mtime records use for eviction)."""
    return [p for p in block_files(store) if inodes.get(p) != p.stat().st_ino]


def answers_fall_back_to_full_prefill(llm, plain_llm, batch, store_down: bool = False) -> dict[str, float]:
    """Sends `batch` at once; every request must report `load_failed` and answer as full prefill
    (failed rows are computed in full: exact, even at ratio 0.15). With `store_down` (loads that
    time out), the store counts as down after the first timeout: the requests planned after it
    find no chunks and are computed in full without a load (not blended, no fallback). Returns
    the counters' change."""
    before = ucm_counters(llm.get_metrics())
    outs = [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in batch], params(), use_tqdm=False)]
    for prompt, got in zip(batch, outs):
        if store_down and got.report["fallback"] is None:
            assert not got.report["blended"], got.report
        else:
            assert got.report["fallback"] == "load_failed", got.report
        assert_same(got, run(plain_llm, prompt), tol=2e-3)
    after = ucm_counters(llm.get_metrics())
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    failed = counts.get("blend_fallbacks_load_failed", 0)
    assert failed == len(batch) if not store_down else 0 < failed <= len(batch), counts
    return counts


def test_failed_loads_are_recomputed_and_never_stored(engine_factory, plain_llm, audit_reference, model_dir, tmp_path,
                                                      monkeypatch):
    # An engine beside the session's (whose KV caches take 4 GiB each): a small KV cache.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    store = tmp_path / "store"
    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store, blend_ratio=0.15,
                                                                         blend_options=STORE_ALL),
                         disable_log_stats=False)
    batch = store_prompts(llm, store, seed=301)
    # Damage every stored block of KV: lookups still find them, every load fails its checksum. The
    # chunk references (a few hundred bytes, read by the scheduler) stay intact: the reordered
    # prompts find their chunks through them and fail loading the exact blocks they name.
    past = time.time() - 3600
    for path in block_files(store):
        if os.path.getsize(path) > REF_FILE_LIMIT:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        os.utime(path, (past, past))
    inodes = {p: p.stat().st_ino for p in block_files(store)}
    counts = answers_fall_back_to_full_prefill(llm, plain_llm, batch)
    assert counts.get("failed_blocks", 0) > 0
    wait_until_stable(store)
    new = written_since(store, inodes)
    assert not new, f"blocks computed over failed loads were stored: {new}"

    # The damaged blocks are gone (removed when their loads failed): the same batch again computes
    # and stores them. An audit against a reference engine then finds every stored block right.
    llm.generate([{"prompt_token_ids": p} for p in batch], params(), use_tqdm=False)
    assert wait_until_stable(store) > 0
    shutdown(llm)
    report = audit_store(store, audit_reference, [{"prompt_token_ids": p} for p in batch])
    assert report.compared > 0 and report.bad == [], report


# Another instance's writer stuck in a hung mount: it holds the store's capacity ledger until told.
HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_store_that_stops_answering_neither_stalls_nor_stores(engine_factory, plain_llm, audit_reference, model_dir,
                                                              tmp_path, monkeypatch):
    """Loads that never finish in time (a prompt's blocks are megabytes; 1 us allowed: since loads
    go into reused buffers a small one can finish within a millisecond) and then dumps
    that get no answer (the capacity ledger's lock held by another process): answers stay full
    prefill's, nothing computed over a timed-out load is stored, and the store is written again once
    it answers."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    store = tmp_path / "store"
    # Whole loads: the 1 us deadline bites a read waited for right after it was submitted; a
    # layer group is waited for later, by when its read may be done (a mount that truly stops
    # answering fails layer-wise reads too: test_mount_faults.py).
    config = ucm_transfer_config(store, blend_ratio=0.15, capacity_gb=8, blend_options=STORE_ALL,
                                 store_options={"load_timeout_s": 1e-6, "lookup_timeout_s": 1.0,
                                                "down_backoff_s": 0.5, "down_backoff_max_s": 1.0}, layerwise=False)
    llm = engine_factory(model_dir, kv_transfer_config=config, disable_log_stats=False)
    batch = store_prompts(llm, store, seed=311)
    inodes = {p: p.stat().st_ino for p in block_files(store)}
    counts = answers_fall_back_to_full_prefill(llm, plain_llm, batch, store_down=True)
    assert counts.get("load_timeout_blocks", 0) > 0, counts
    wait_until_stable(store)
    new = written_since(store, inodes)
    if counts["blend_fallbacks_load_failed"] == len(batch):  # else some were computed without a load: stored
        assert not new, f"blocks computed over timed-out loads were stored: {new}"

    before_hold = len(block_files(store))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store / LEDGER_NAME)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        fresh = [prompts(llm, seed=s)[0] for s in (321, 322)]
        before = ucm_counters(llm.get_metrics())
        outs = [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in fresh], params(), use_tqdm=False)]
        for prompt, got in zip(fresh, outs):  # nothing to load: computed in full, as plain vLLM does
            assert_same(got, run(plain_llm, prompt), tol=2e-3)
        after = ucm_counters(llm.get_metrics())
        # refused after the ledger's deadline, or at once while the store counts as down after it
        refused = sum(after.get(k, 0) - before.get(k, 0) for k in ("dump_timeout_blocks", "store_down_blocks"))
        assert refused > 0
        assert len(block_files(store)) == before_hold, "a dump went through while the ledger was held"
    finally:
        holder.stdin.close()  # lets go of the lock
        holder.wait(30)
    # The store answers again: after the back-off (at most down_backoff_max_s) the next new prompt is stored.
    time.sleep(1.5)
    last = prompts(llm, seed=323)[0]
    run(llm, last)
    assert wait_until_stable(store) > before_hold
    # Whatever was stored is right: an audit against a reference engine finds no wrong block.
    shutdown(llm)
    report = audit_store(store, audit_reference, [{"prompt_token_ids": p} for p in [*batch, *fresh, last]])
    assert report.compared > 0 and report.bad == [], report
