"""The scheduler half of the connector on a real store: the Blend region reported to vLLM as
computed, the per-step cap on Blend work, prefix-cache hygiene and preemption.

Requests are stand-ins with the fields vLLM's `Request` gives the connector; the store is a real
UcmNfsStore directory holding each chunk block under its CHUNK key.
"""

from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import os
import time
import numpy as np
import pytest

from ucm.config import UCMConfig
from ucm.integration.vllm.connector.request_params import RequestParamPolicy
from ucm.integration.vllm.connector.request_state import isolation_of
from ucm.integration.vllm.connector.scheduler_side import SchedulerSide
from ucm.integration.vllm.faults import FAULTS_ENV
from ucm.sparse.blend.chunking import split_by_marker
from ucm.sparse.blend.hashing import BlockHasher
from ucm.sparse.blend.plan import build_plan
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind

BS, MARKER = 4, 2
STORE_ALL = "first_sighting"  # tests of the dumps themselves: every computed block is stored (no admission filter)


def side_for(tmp_path, max_step_tokens=None, ratio=0.5, store_extra=None, kv_role="kv_both", **blend_extra):
    blend = {"chunk_end_token_id": MARKER, "compute_meta": {"model.layers.1.self_attn.attn": {"ratio": ratio}}}
    if max_step_tokens is not None:
        blend["max_step_tokens"] = max_step_tokens
    blend.update(blend_extra)
    config = UCMConfig.from_extra_config({
        "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore",
                            "ucm_connector_config": {"storage_backends": str(tmp_path / "store"),
                                                     **(store_extra or {})}}],
        "ucm_sparse_config": {"Blend": blend}})
    store = create_store("UcmNfsStore", config.stores[0].config)
    side = SchedulerSide(config, store, b"test-namespace", BS, "sha256", step_budget=64, kv_role=kv_role)
    side._hasher = BlockHasher.from_seed("sha256", BS, "test")
    return side


def prompt(seed):
    """Three chunks (each ending with the marker) and a 3-token question: 22 tokens."""
    rng = np.random.default_rng(seed)
    chunks = [list(rng.integers(10, 1000, n)) + [MARKER] for n in (5, 6, 5)]
    return [int(t) for c in chunks for t in c] + [7, 8, 9]


def store_chunks(side, tokens, cache_salt=None, lora_request=None):
    """Stores every chunk block of `tokens` as CHUNK KV of that tenant and adapter."""
    isolation = isolation_of(SimpleNamespace(cache_salt=cache_salt, lora_request=lora_request))
    plan = build_plan(split_by_marker(tokens, MARKER), tokens, side.hasher, 0, lambda kind, hs: [False] * len(hs),
                      isolation)
    space = side.keys_for(lora_request)
    keys = [space.key(KeyKind.CHUNK, b.block_hash) for b in plan.blocks]
    buffers = [np.zeros(64 * len(b.tokens), dtype=np.uint8) for b in plan.blocks]
    assert all(side.store.wait(side.store.dump(keys, buffers, [len(b.tokens) for b in plan.blocks])))


def request(side, req_id, tokens, cache_salt=None, lora_request=None):
    iso = isolation_of(SimpleNamespace(cache_salt=cache_salt, lora_request=lora_request))
    hashes = side.hasher.prefix_hashes(tokens, extra_keys=[iso.block_keys(i) for i in range(len(tokens) // BS)])
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, kv_transfer_params=None, num_computed_tokens=0,
                           num_tokens=len(tokens), block_hashes=hashes, cache_salt=cache_salt,
                           lora_request=lora_request)


def admit(side, req, num_external):
    blocks = list(range(1, len(req.prompt_token_ids) // BS + 2))
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), num_external)
    return SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=num_external)


def step(side, new, scheduled, preempted=(), resumed=None):
    """One scheduler step's output; `resumed` (V1 runner): {req_id: block ids} of resumed requests."""
    resumed = resumed or {}
    cached = SimpleNamespace(req_ids=list(resumed), resumed_req_ids=set(resumed),
                             new_block_ids=[(ids,) for ids in resumed.values()],
                             num_computed_tokens=[scheduled.pop(f"{r}:computed") for r in resumed])
    out = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                          has_sync_kv_loads=False, preempted_req_ids=set(preempted))
    return side.build_connector_meta(out), out


def first_step(side, req):
    """Looks `req` up, admits it with what the lookup offered and runs its first step (one token
    scheduled); returns step()'s (metadata, output)."""
    new = admit(side, req, side.get_num_new_matched_tokens(req, 0)[0])
    return step(side, [new], {req.request_id: 1})


def preempt(side, req, outputs=0):
    """vLLM preempts the running request: its blocks are freed, its computed count reset."""
    step(side, [], {}, preempted={req.request_id})
    req.num_computed_tokens = 0
    req.num_tokens = len(req.prompt_token_ids) + outputs


def test_loaded_region_is_reported_computed_and_handed_over_per_request(tmp_path):
    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    original = list(req.block_hashes)
    external, load_async = side.get_num_new_matched_tokens(req, 0)
    assert (external, load_async) == (21, False)  # all but the last token: the only one scheduled
    # Blocks holding blended KV get request-unique hashes before vLLM caches them (every chunk
    # here was stored as CHUNK KV, so the KV is approximate from token 0).
    assert all(h != o for h, o in zip(req.block_hashes, original))
    new = admit(side, req, external)
    meta, out = step(side, [new], {"a": 1})
    (s,) = meta.requests
    assert s.blend.start == 0 and s.blend.end == 21 and s.blend.token_ids == tokens[:21]
    assert s.blend.ratio == 0.5 and s.blend.question_end == len(tokens) and s.blend.selection == "query"
    assert sum(ld.num_tokens - ld.skip for ld in s.chunk_loads) == 19
    assert out.has_sync_kv_loads  # loads land before the forward
    report = side.request_finished(req)["ucm"]
    assert report["blended"] and report["blend_region_tokens"] == 21 and report["external_prefix_tokens"] == 0
    assert report["fallback"] is None and report["chunk_hit_tokens"] == 19
    assert sum(n for _, n, _ in report["chunk_hits"]) == report["chunk_blocks"]
    assert sum(hit for _, _, hit in report["chunk_hits"]) == report["chunk_hit_blocks"]
    assert side.stats.data["blended_requests"] == 1


def test_blend_work_over_the_step_cap_waits_a_step(tmp_path):
    side = side_for(tmp_path, max_step_tokens=12)  # region work: 2 question tokens + ceil(0.5 * 19) = 12 per request
    a, b = request(side, "a", prompt(1)), request(side, "b", prompt(2))
    store_chunks(side, a.prompt_token_ids)
    store_chunks(side, b.prompt_token_ids)
    original_b = list(b.block_hashes)
    first = admit(side, a, side.get_num_new_matched_tokens(a, 0)[0])
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)  # 10 + 10 > 12: vLLM keeps it queued
    assert side.stats.data["blend_deferrals"] == 1
    step(side, [first], {"a": 1})  # the step ends: its Blend work starts from zero again
    lookups = []
    side.store.lookup = lambda keys, _real=side.store.lookup: lookups.append(keys) or _real(keys)
    assert side.get_num_new_matched_tokens(b, 0) == (21, False)
    assert not lookups  # a deferred request keeps its plan
    salted = list(b.block_hashes)
    side.hashes.restore(b)  # salted from the originals, not twice
    assert b.block_hashes == original_b
    side.hashes.salt(b, 0)
    assert b.block_hashes == salted
    side.hashes.restore(b)
    assert b.block_hashes == original_b


def test_a_region_with_more_work_than_the_cap_is_cut_to_fit(tmp_path):
    """Work of the whole region: 2 question rows + ceil(0.5 * 19) = 12 > 6. The longest region
    within 6 rows ends at 12, inside the block [10, 13): cut at 10, never through a loaded block;
    vLLM's chunked prefill computes the rest."""
    side = side_for(tmp_path, max_step_tokens=6)
    req = request(side, "a", prompt(1))
    store_chunks(side, req.prompt_token_ids)
    assert side.get_num_new_matched_tokens(req, 0) == (10, False)
    meta, _ = step(side, [admit(side, req, 10)], {"a": 12})
    (s,) = meta.requests
    assert s.blend.end == 10 and all(ld.start + ld.num_tokens <= 10 for ld in s.chunk_loads)
    assert side.request_finished(req)["ucm"]["fallback"] == "region_cut"
    assert side.stats.data["blend_fallbacks_region_cut"] == 1
    tiny = side_for(tmp_path, max_step_tokens=1)  # not even one loaded block fits: vLLM computes it all
    req = request(tiny, "b", prompt(1))
    assert tiny.get_num_new_matched_tokens(req, 0) == (0, False)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_preempted_blend_request_blends_again_under_new_hashes(tmp_path, runner):
    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    original = list(req.block_hashes)
    (first,) = first_step(side, req)[0].requests
    first_salted = list(req.block_hashes)
    preempt(side, req, outputs=2)
    # Its blended blocks, freed into vLLM's cache under request-unique hashes, can no longer match:
    # vLLM's own lookup on readmission sees the exact hashes.
    assert req.block_hashes == original
    assert side.get_num_new_matched_tokens(req, 0) == (21, False)  # planned and blended again
    assert all(h not in first_salted and h not in original for h in req.block_hashes)  # a new generation
    again = admit(side, req, 21)
    if runner == "v2":  # resumed requests come among the new ones
        meta, out = step(side, [again], {"a": 1})
    else:  # among the cached ones, flagged resumed, with all their blocks
        meta, out = step(side, [], {"a": 1, "a:computed": 21}, resumed={"a": list(again.block_ids[0])})
    (s,) = meta.requests
    assert s.blend == first.blend and s.chunk_loads == first.chunk_loads and out.has_sync_kv_loads
    assert not any(d.key in {side.view.space.key(KeyKind.EXACT, h) for h in original} for d in s.dumps)
    report = side.request_finished(req)["ucm"]
    assert report["blended"] and report["fallback"] is None and report["preemptions"] == 1
    assert side.stats.data["blended_requests"] == 1 and side.stats.data["blend_preemptions"] == 1
    assert side.stats.data["requests"] == 1


def test_preempted_blend_request_whose_chunks_are_gone_is_computed_in_full(tmp_path):
    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    first_step(side, req)
    preempt(side, req)
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            path.unlink()
    side.view.pending.clear()
    side.view.forget_known()  # as a failed load makes it (test_a_block_found_stored_is_not_asked_for_again...)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.stats.data["blend_fallbacks_preempted"] == 1
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(tokens)})
    assert all(not r.blend and not r.chunk_loads for r in meta.requests)
    report = side.request_finished(req)["ucm"]
    assert not report["blended"] and report["fallback"] == "preempted" and report["preemptions"] == 1


def test_a_store_lookup_past_its_timeout_computes_the_request_in_full_and_counts_it(tmp_path):
    """A hung mount must not stall the scheduler: while a store lookup is blocked past
    lookup_timeout_s (here 100,000 stats), requests are planned with misses at once."""
    from ucm.store.keys import store_key

    tokens = prompt(1)
    store_chunks(side_for(tmp_path), tokens)  # a writer that waits for its lookups
    side = side_for(tmp_path, store_extra={"lookup_timeout_s": 0.001})
    slow = [store_key(b"other", KeyKind.CHUNK, i.to_bytes(32, "little")) for i in range(100_000)]
    assert not any(side.store.lookup(slow))
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.stats.data["lookup_timeout_blocks"] > 0
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(tokens)})
    assert all(not r.blend and not r.chunk_loads for r in meta.requests)
    assert not side.request_finished(req)["ucm"]["blended"]


def test_chunk_kv_is_shared_within_a_tenant_and_adapter_only(tmp_path):
    from tiny_adapter import write_adapter
    from vllm.lora.request import LoRARequest

    side = side_for(tmp_path)
    tokens = prompt(1)
    adapter = LoRARequest("adapter", 1, str(write_adapter(tmp_path / "adapters" / "a")))
    copy = LoRARequest("adapter", 1, str(write_adapter(tmp_path / "adapters" / "b")))  # vLLM hashes the path
    store_chunks(side, tokens, cache_salt="tenant-a")
    store_chunks(side, tokens, lora_request=adapter)
    cases = [("tenant-a", None, True), ("tenant-b", None, False), (None, None, False), (None, adapter, True),
             ("tenant-a", adapter, False), (None, copy, False)]
    for i, (salt, lora, shared) in enumerate(cases):
        req = request(side, f"r{i}", tokens, cache_salt=salt, lora_request=lora)
        assert side.get_num_new_matched_tokens(req, 0) == ((21 if shared else 0), False), (salt, lora)
        report = side.request_finished(req)["ucm"]
        assert report["chunk_hit_blocks"] == (report["chunk_blocks"] if shared else 0)


def _computed_keys(side, req_id, tokens, **request_kw):
    """Every store key a request with nothing to load hands out when its whole prompt is computed
    (dumps, chunk references, sightings), and the block hashes those keys can name."""
    req = request(side, req_id, tokens, **request_kw)
    _reap_records(side)
    refs = len(side.view.refs_waiting)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0
    meta, _ = step(side, [admit(side, req, 0)], {req_id: len(tokens)})
    keys = ({d.key for r in meta.requests for d in r.dumps} | {r.key for r in side.view.refs_waiting[refs:]}
            | {k for task, _, _ in side.view.record_writes for k in task.keys})
    hashes = list(req.block_hashes) + [b.block_hash for b in side._states[req_id].plan.blocks]
    side.request_finished(req)
    return keys, hashes


def _engine_keys(hashes):
    """The keys of these block hashes in the engine's namespace (requests without an adapter)."""
    from ucm.store.keys import store_key

    return {store_key(b"test-namespace", kind, h) for kind in KeyKind for h in hashes}


@pytest.mark.parametrize("admission", [STORE_ALL, "second_sighting"])
def test_requests_without_an_adapter_keep_their_store_keys(tmp_path, admission):
    side = side_for(tmp_path, admission=admission)
    keys, hashes = _computed_keys(side, "a", prompt(1))
    assert keys and keys <= _engine_keys(hashes)


@pytest.mark.parametrize("admission", [STORE_ALL, "second_sighting"])
def test_lora_store_keys_follow_the_adapters_files_not_its_name_and_path(tmp_path, admission):
    """Issue 57: vLLM's block hashes name an adapter by name and path; retrained in place it keeps
    both, and its requests must then find none of the old adapter's KV, references or sightings."""
    from tiny_adapter import retrain_in_place, write_adapter
    from vllm.lora.request import LoRARequest

    side = side_for(tmp_path, admission=admission)
    path = write_adapter(tmp_path / "adapter", seed=1)
    lora = LoRARequest("adapter", 1, str(path))
    old, hashes = _computed_keys(side, "old", prompt(1), lora_request=lora)
    assert old and not old & _engine_keys(hashes)
    retrain_in_place(path, seed=2)
    new, new_hashes = _computed_keys(side, "new", prompt(1), lora_request=lora)
    assert new_hashes == hashes and new and not new & old


def test_an_adapter_retrained_in_place_does_not_load_the_old_adapters_kv(tmp_path):
    import shutil

    from tiny_adapter import retrain_in_place, write_adapter
    from vllm.lora.request import LoRARequest

    side = side_for(tmp_path)
    tokens = prompt(1)
    path = write_adapter(tmp_path / "adapter", seed=1)
    lora = LoRARequest("adapter", 1, str(path))
    store_chunks(side, tokens, lora_request=lora)
    assert side.get_num_new_matched_tokens(request(side, "a", tokens, lora_request=lora), 0) == (21, False)
    # The same files elsewhere: the same key space (vLLM's hashes still differ, they name the path).
    copy = LoRARequest("renamed", 2, str(shutil.copytree(path, tmp_path / "copy")))
    assert side.keys_for(copy) == side.keys_for(lora) != side.view.space
    h = request(side, "x", tokens, lora_request=lora).block_hashes[0]
    exact = [side.keys_for(lora).key(KeyKind.EXACT, h)]
    assert all(side.store.wait(side.store.dump(exact, [np.zeros(64 * BS, dtype=np.uint8)], [BS])))
    assert side.stored(h, lora) and not side.stored(h)  # a background chunk's check, under its adapter
    retrain_in_place(path, seed=2)
    assert side.get_num_new_matched_tokens(request(side, "b", tokens, lora_request=lora), 0) == (0, False)
    assert not side.stored(h, lora)


@pytest.mark.parametrize("broken", ["missing", "no_weights", "no_config"])
def test_a_request_whose_adapter_cannot_be_read_is_left_to_vllm(tmp_path, broken):
    """No digest, no store: the request neither loads nor stores anything, and says why."""
    import shutil

    from tiny_adapter import write_adapter
    from vllm.lora.request import LoRARequest

    side = side_for(tmp_path, admission=STORE_ALL)
    tokens = prompt(1)
    path = write_adapter(tmp_path / "adapter")
    lora = LoRARequest("adapter", 1, str(path))
    store_chunks(side, tokens, lora_request=lora)
    if broken == "missing":
        shutil.rmtree(path)
    else:
        (path / ("adapter_model.safetensors" if broken == "no_weights" else "adapter_config.json")).unlink()
    req = request(side, "a", tokens, lora_request=lora)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(tokens)})
    assert not any(r.dumps or r.blend or r.prefix_loads for r in meta.requests)
    assert not side.view.refs_waiting and not side.view.record_writes
    report = side.request_finished(req)["ucm"]
    assert report["fallback"] == "adapter_unreadable" and not report["blended"]
    assert side.stats.data["blend_fallbacks_adapter_unreadable"] == 1
    assert side.stored(b"h" * 32, lora)  # nothing of it would be stored: nothing to compute in the background


def test_multimodal_requests_do_not_reuse_chunk_kv(tmp_path):
    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    req.mm_features = [object()]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.stats.data["blend_skipped_multimodal"] == 1


def test_opted_out_request_is_planned_but_not_blended(tmp_path):
    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    req.kv_transfer_params = {"ucm_disable_blend": True}
    original = list(req.block_hashes)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.block_hashes == original  # computed in full: exact, shareable
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(tokens)})
    assert all(r.blend is None for r in meta.requests)
    report = side.request_finished(req)["ucm"]
    assert not report["blended"] and report["fallback"] is None and report["chunk_hit_blocks"] > 0


@pytest.mark.parametrize("cap", [0, -3, True, 2.5])
def test_max_step_tokens_must_be_a_positive_int(cap):
    from ucm.config import UCMConfigError

    with pytest.raises(UCMConfigError, match="max_step_tokens"):
        UCMConfig.from_extra_config({
            "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore", "ucm_connector_config": {"storage_backends": "/x"}}],
            "ucm_sparse_config": {"Blend": {"max_step_tokens": cap, "compute_meta": {
                "model.layers.1.self_attn.attn": {"ratio": 0.2}}}}})


KNOBS = {"ucm_blend_ratio": 1.0, "ucm_blend_selection": "oracle", "ucm_exact_prefix": False, "other_connector": 1}


@pytest.mark.parametrize("serving,config,honoured", [
    (False, {}, {"ucm_blend_ratio", "ucm_blend_selection", "ucm_exact_prefix"}),  # offline: everything
    (True, {}, set()),  # an API server: nothing unless the operator lists it
    (True, {"request_params": ["ucm_blend_ratio", "ucm_blend_selection"]}, {"ucm_blend_ratio"}),  # no oracle
    (True, {"request_params": ["ucm_blend_selection"], "allow_oracle": True}, {"ucm_blend_selection"}),
    (False, {"allow_oracle": False}, {"ucm_blend_ratio", "ucm_exact_prefix"}),
])
def test_per_request_parameters_follow_the_operators_policy(tmp_path, monkeypatch, serving, config, honoured):
    if serving:
        monkeypatch.setenv("UCM_API_SERVER", "1")
    else:
        monkeypatch.delenv("UCM_API_SERVER", raising=False)
    side = side_for(tmp_path, **config)
    req = request(side, "a", prompt(1))
    req.kv_transfer_params = dict(KNOBS)
    params, refused = side.request_params(req)
    assert set(params) == honoured
    assert set(refused) == {"ucm_blend_ratio", "ucm_blend_selection", "ucm_exact_prefix"} - honoured
    store_chunks(side, req.prompt_token_ids)
    side.get_num_new_matched_tokens(req, 0)
    step(side, [admit(side, req, 21)], {"a": 1})
    report = side.request_finished(req)["ucm"]
    assert set(report["refused_params"]) == set(refused)
    assert report["ratio"] == (1.0 if "ucm_blend_ratio" in honoured else 0.5)
    assert report["selection"] == ("oracle" if "ucm_blend_selection" in honoured else "query")
    assert side.stats.data.get("request_params_refused", 0) == (1 if refused else 0)


@pytest.mark.parametrize("bad", [["ucm_blend_ratio", "ucm_typo"], "ucm_blend_ratio", {"allow_oracle": "yes"}])
def test_request_policy_config_errors_name_the_problem(bad):
    from ucm.config import UCMConfigError

    blend = {"compute_meta": {"model.layers.1.self_attn.attn": {"ratio": 0.2}}}
    blend.update(bad if isinstance(bad, dict) else {"request_params": bad})
    with pytest.raises(UCMConfigError, match="request_params|allow_oracle"):
        UCMConfig.from_extra_config({
            "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore", "ucm_connector_config": {"storage_backends": "/x"}}],
            "ucm_sparse_config": {"Blend": blend}})


@pytest.mark.parametrize("policy", ["any", "alone", "refs"])
def test_chunk_store_policy_decides_which_missed_chunks_are_stored(tmp_path, policy):
    """A prompt new to the store: its full blocks are exact (stored as the prefix either way) and
    its first chunk has nothing before it; the later chunks were computed after other text, so
    under "alone" their chunk KV is not stored. With chunk references ("refs", the default) the
    later chunks' blocks, all inside the exact blocks, are stored as references, not as KV."""
    side = (side_for(tmp_path, admission=STORE_ALL) if policy == "refs"
            else side_for(tmp_path, chunk_store=policy, chunk_refs=False, admission=STORE_ALL))
    tokens = prompt(1)  # chunks [0, 6) [6, 13) [13, 19), question [19, 22)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(tokens)})
    (s,) = meta.requests
    chunk_keys = {side.view.space.key(KeyKind.CHUNK, b.block_hash) for b in side._states["a"].plan.blocks}
    stored_as_chunk = [d for d in s.dumps if d.key in chunk_keys]
    exact = [d for d in s.dumps if d.key not in chunk_keys]
    assert [d.start for d in exact] == [0, 4, 8, 12, 16, 4]  # 5 prefix blocks + the first chunk's tail
    blocks = side._states["a"].plan.blocks
    ref_keys = [side.view.space.key(KeyKind.CHUNK_REF, b.block_hash) for b in blocks if b.chunk_start > 0]
    assert side.store.lookup(ref_keys) == [False] * 4  # not before the exact blocks they name are stored
    _worker_stores(side, s.dumps)
    step(side, [], {})  # the next step writes the references
    side.store.close()  # waits for the references' writes
    refs_stored = create_store("UcmNfsStore", {"storage_backends": str(tmp_path / "store")}).lookup(ref_keys)
    if policy == "any":
        assert {(d.start, d.num_tokens) for d in stored_as_chunk} == {(6, 4), (10, 3), (13, 4), (17, 2)}
    else:
        assert stored_as_chunk == []
    assert refs_stored == [policy == "refs"] * 4


@pytest.mark.parametrize("knobs,expected", [
    ({}, 0),  # the default rule ranks everything
    ({"ucm_chunk_start_tokens": 16}, 16),  # EPIC's rows first, then the ranking
    ({"ucm_blend_selection": "chunk_start"}, 16),  # EPIC alone: its default k
    ({"ucm_blend_selection": "chunk_start", "ucm_chunk_start_tokens": 8}, 8),
    ({"ucm_chunk_start_tokens": -1}, 0),  # refused with a warning: the configured default
    ({"ucm_blend_selection": "chunk_start", "ucm_chunk_start_tokens": 0}, 16),  # EPIC needs k >= 1
])
def test_chunk_start_tokens_per_request_and_rule(tmp_path, monkeypatch, knobs, expected):
    region, report = _blended_with(tmp_path, monkeypatch, knobs)
    assert region.chunk_start_tokens == expected and region.chunk_starts
    assert report["blended"] and report["chunk_start_tokens"] == expected


def _blended_with(tmp_path, monkeypatch, knobs, **blend):
    """(the Blend region handed to the worker, the connector's report) of one request with `knobs`,
    all its chunks stored; `blend` overrides the Blend config."""
    monkeypatch.delenv("UCM_API_SERVER", raising=False)
    side = side_for(tmp_path)
    side.blend = side.lookup.blend = dataclasses.replace(side.blend, **blend)
    side.params = side.lookup.params = RequestParamPolicy(side.blend)
    req = request(side, "a", prompt(1))
    req.kv_transfer_params = dict(knobs)
    store_chunks(side, req.prompt_token_ids)
    side.get_num_new_matched_tokens(req, 0)
    meta, _ = step(side, [admit(side, req, 21)], {"a": 1})
    (s,) = meta.requests
    return s.blend, side.request_finished(req)["ucm"]


@pytest.mark.parametrize("knobs,configured,expected", [
    ({}, 0.0, 0.0), ({"ucm_kv_shift": True}, 0.0, 1.0), ({}, 0.5, 0.5), ({"ucm_kv_shift": False}, 0.5, 0.0),
    ({"ucm_kv_shift": 0.25}, 0.0, 0.25),
    # refused with a warning: the configured value
    ({"ucm_kv_shift": "yes"}, 0.5, 0.5), ({"ucm_kv_shift": 2}, 0.0, 0.0),
])
def test_kv_shift_per_request(tmp_path, monkeypatch, knobs, configured, expected):
    region, report = _blended_with(tmp_path, monkeypatch, knobs, kv_shift=configured)
    assert region.kv_shift == expected and report["kv_shift"] == expected


def _store_shards(side, tokens, shards):
    """Store each chunk block of `tokens` for the given tensor-parallel ranks only."""
    from ucm.store.keys import shard_key

    plan = build_plan(split_by_marker(tokens, MARKER), tokens, side.hasher, 0, lambda kind, hs: [False] * len(hs))
    keys = [shard_key(side.view.space.key(KeyKind.CHUNK, b.block_hash), r, side.view.num_shards) for b in plan.blocks for r in shards]
    sizes = [len(b.tokens) for b in plan.blocks for _ in shards]
    assert all(side.store.wait(side.store.dump(keys, [np.zeros(64 * n, dtype=np.uint8) for n in sizes], sizes)))
    return plan


def test_a_dump_counts_as_stored_only_once_the_workers_confirm_it(tmp_path):
    """Submitted dumps are misses until confirmed: a request needing them waits (a short while),
    then loads them; a dump a worker could not write is never served."""
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, chunk_refs=False, admission=STORE_ALL)  # copies only (references: the tests below)
    tokens = prompt(1)
    a = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)  # nothing stored: computed in full
    meta, _ = step(side, [admit(side, a, 0)], {"a": len(tokens)})
    dumps = [d for r in meta.requests for d in r.dumps]
    assert dumps and all(d.key in side.view.pending for d in dumps)
    b = request(side, "b", tokens)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)  # its blocks are being written: wait
    assert side.stats.data["dump_waits"] == 1
    side.take_report(UCMWorkerReport(not_stored={dumps[0].key}))
    side.take_report(UCMWorkerReport(stored={d.key: 1 for d in dumps[1:]}))
    assert not side.view.pending
    # The worker's report says the first was not stored: a miss, however long it waits (the
    # others count as stored on the workers' word: this test's store holds none of them).
    external, _ = side.get_num_new_matched_tokens(b, 0)
    meta, _ = step(side, [admit(side, b, external)], {"b": 1})
    loads = [ld.key for r in meta.requests for ld in (*r.prefix_loads, *r.chunk_loads)]
    assert loads and dumps[0].key not in loads and set(loads) <= {d.key for d in dumps[1:]}


def test_a_block_found_stored_is_not_asked_for_again_until_a_load_fails(tmp_path, monkeypatch):
    """Stored blocks never change, so a hit is remembered (KNOWN_SECONDS) instead of asking a slow
    mount again; blocks gone meanwhile (another instance evicted them) are planned as hits until a
    load fails, which makes the scheduler ask the store again."""
    from ucm.integration.vllm.connector import store_view
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path)
    tokens = prompt(1)
    store_chunks(side, tokens)
    assert side.get_num_new_matched_tokens(request(side, "a", tokens), 0)[0] == 21
    known = side.stats.data["lookup_known_blocks"]  # each chunk's first block, found by the probe
    _evict_every_block(tmp_path / "store")
    assert side.get_num_new_matched_tokens(request(side, "b", tokens), 0)[0] == 21  # from memory
    assert side.stats.data["lookup_known_blocks"] - known >= 6  # every chunk block
    side.take_report(UCMWorkerReport(load_failed={"b"}))
    assert side.get_num_new_matched_tokens(request(side, "c", tokens), 0) == (0, False)
    store_chunks(side, tokens)
    assert side.get_num_new_matched_tokens(request(side, "d", tokens), 0)[0] == 21
    monkeypatch.setattr(store_view, "KNOWN_SECONDS", 0.0)  # remembered no longer: asked again
    _evict_every_block(tmp_path / "store")
    assert side.get_num_new_matched_tokens(request(side, "e", tokens), 0) == (0, False)


def _evict_every_block(store_dir):
    """Block files removed behind the engine's back (the root's marker stays)."""
    from ucm.store.roots import ROOT_MARKER

    for path in store_dir.rglob("*"):
        if path.is_file() and not path.name.startswith(ROOT_MARKER):
            path.unlink()


@pytest.mark.parametrize("stored, first, asked", [
    (0, 0, [8]),  # new text: one short lookup
    (100, 0, [8, 92]),  # stored whole: the rest asked for once the first 8 are found
    (40, 0, [8, 92]),
    (5, 0, [8]),  # blocks after the first miss are taken as not stored
    (0, 95, [100]),  # vLLM's own hits, then the 5 left: the whole prompt
])
def test_exact_prompt_blocks_are_asked_for_past_the_first_8_only_when_all_were_found(stored, first, asked):
    from ucm.integration.vllm.connector.request_lookup import leading_hits

    calls = []

    def lookup(kind, hashes):
        calls.append(len(hashes))
        return [h < stored for h in hashes]

    found = leading_hits(lookup, list(range(100)), first)
    assert calls == asked and len(found) == 100
    assert found == [h < stored and (stored > 8 or h < 8 + first) for h in range(100)]


def test_tensor_parallel_blocks_are_found_only_with_every_ranks_shard(tmp_path):
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path)
    side.view.num_shards = 2
    tokens = prompt(3)
    _store_shards(side, tokens, shards=[0])  # rank 1's shards missing: no chunk hit
    assert side.get_num_new_matched_tokens(request(side, "a", tokens), 0) == (0, False)
    _store_shards(side, tokens, shards=[1])
    assert side.get_num_new_matched_tokens(request(side, "b", tokens), 0) == (21, False)
    single = side_for(tmp_path)  # a TP=1 engine on the same directory finds none of them
    assert single.get_num_new_matched_tokens(request(single, "c", tokens), 0) == (0, False)
    side.view.pending[b"k"] = time.monotonic()
    side.take_report(UCMWorkerReport(stored={b"k": 1}))
    assert b"k" in side.view.pending  # one rank of two
    side.take_report(UCMWorkerReport(stored={b"k": 1}))
    assert b"k" not in side.view.pending


def test_a_request_whose_load_failed_dumps_nothing_more_and_says_so(tmp_path):
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, max_step_tokens=None)
    tokens = prompt(4)
    store_chunks(side, tokens[:6])  # the first chunk only
    req = request(side, "a", tokens)
    first_step(side, req)
    side.take_report(UCMWorkerReport(load_failed={"a"}))
    assert side._states["a"].untrusted and side._dumps(side._states["a"], len(tokens) + 8) == []
    report = side.request_finished(req)["ucm"]
    assert report["fallback"] == "load_failed"
    assert side.stats.data["blend_fallbacks_load_failed"] == 1


@pytest.mark.parametrize("min_hit_share,blends", [(0.0, True), (0.25, True), (0.5, False)])
def test_requests_with_few_chunk_hits_are_left_to_vllm(tmp_path, min_hit_share, blends):
    """One chunk of three stored: 6 of the 21 tokens before the last one (29%) have chunk KV."""
    side = side_for(tmp_path, min_hit_share=min_hit_share, admission=STORE_ALL)
    tokens = prompt(5)
    store_chunks(side, tokens[:6])
    req = request(side, "a", tokens)
    external, _ = side.get_num_new_matched_tokens(req, 0)
    assert external == (21 if blends else 0)
    meta, _ = step(side, [admit(side, req, external)], {"a": len(tokens) - external})
    (s,) = meta.requests
    assert (s.blend is not None) == blends and bool(s.chunk_loads) == blends
    if not blends:  # computed by vLLM: its blocks are exact and stored as such
        assert {d.key for d in s.dumps} >= {side.view.space.key(KeyKind.EXACT, h) for h in req.block_hashes}
    report = side.request_finished(req)["ucm"]
    assert report["fallback"] == (None if blends else "few_hits") and report["blended"] == blends
    assert side.stats.data.get("blend_fallbacks_few_hits", 0) == (0 if blends else 1)


def _worker_stores(side, dumps, failed=()):
    """The worker's part: the dumps (zeros) written to the store and confirmed, but `failed`."""
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    good = [d for d in dumps if d.key not in failed]
    buffers = [np.zeros(64 * d.num_tokens, dtype=np.uint8) for d in good]
    assert all(side.store.wait(side.store.dump([d.key for d in good], buffers, [d.num_tokens for d in good])))
    side.take_report(UCMWorkerReport(stored={d.key: 1 for d in good}, not_stored=set(failed)))


def _computed_in_full(side, req_id, tokens, failed=()):
    """A request computed in full, its dumps stored (but `failed`); then one more step."""
    req = request(side, req_id, tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta, _ = step(side, [admit(side, req, 0)], {req_id: len(tokens)})
    dumps = [d for r in meta.requests for d in r.dumps]
    _worker_stores(side, dumps, failed)
    side.request_finished(req)
    step(side, [], {})
    return dumps


def test_chunks_computed_in_full_are_found_through_references_to_their_exact_blocks(tmp_path):
    """Prompt a computes chunks [0, 6) [6, 13) [13, 19) in full: its exact blocks hold every
    chunk's KV, so the later chunks are stored as references, not as a second copy. Prompt b
    (chunks in the order 0, 2, 1) finds them and reads their rows from a's exact blocks, K moved
    by the chunk's new offset minus its old one."""
    side = side_for(tmp_path, admission=STORE_ALL)
    a = prompt(1)
    dumps = _computed_in_full(side, "a", a)
    assert all(d.rope_delta == 0 for d in dumps)  # exact blocks only: no KV rotated back and stored twice
    for _ in range(100):  # the references are written by the store's threads
        side.view.reap_record_writes()
        if side.stats.data.get("chunk_refs_stored") == 4:
            break
        time.sleep(0.01)
    assert side.stats.data["chunk_refs_stored"] == 4  # blocks (6, 4) (10, 3) (13, 4) (17, 2)

    b_tokens = a[0:6] + a[13:19] + a[6:13] + a[19:]
    b = request(side, "b", b_tokens)
    external, _ = side.get_num_new_matched_tokens(b, 0)
    plan = side._states["b"].plan
    assert plan.prefix_tokens == 4 and external == len(b_tokens) - 1
    refs = [blk for blk in plan.blocks if blk.kind is KeyKind.CHUNK_REF]
    assert [(blk.tokens.start, blk.ref.position) for blk in refs] == [(6, 13), (10, 17), (12, 6), (16, 10)]
    (s,) = step(side, [admit(side, b, external)], {"b": 1})[0].requests
    exact = {side.view.space.key(KeyKind.EXACT, h): i for i, h in enumerate(request(side, "x", a).block_hashes)}
    # (exact block of a, its rows, new position, rotation) of every row loaded through a reference
    rows = [(exact[ld.key], ld.rows_from + r, ld.start + r, ld.rope_delta)
            for ld in s.chunk_loads if ld.key in exact and ld.stored_tokens == BS for r in range(ld.num_tokens)]
    moved = [(p // BS, p % BS, new, new - p) for new, p in zip(range(6, 19), [*range(13, 19), *range(6, 13)])]
    assert rows == moved
    assert side.stats.data["chunk_ref_hit_blocks"] == 4


def test_a_reference_whose_exact_blocks_are_gone_is_a_miss(tmp_path):
    side = side_for(tmp_path, admission=STORE_ALL)
    a = prompt(1)
    dumps = _computed_in_full(side, "a", a)
    side.store.close()  # the references are written
    side.view.store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path / "store")})
    gone = next(d for d in dumps if d.start == 16)  # holds rows 16..19: the blocks (13, 4) and (17, 2) of a
    os.remove(side.store.block_path(gone.key))
    side.view.forget_known()  # as 30 s later, or after a load of it failed
    b = request(side, "b", a[0:6] + a[13:19] + a[6:13] + a[19:])
    side.get_num_new_matched_tokens(b, 0)
    plan = side._states["b"].plan
    assert [blk.tokens.start for blk in plan.blocks if blk.kind is KeyKind.CHUNK_REF] == [12, 16]
    assert [blk.tokens.start for blk in plan.missed] == [6, 10]


def _stored_refs(side, tokens, store_dir):
    """{prompt position: reference stored} of the later chunks' blocks of `tokens`."""
    side.store.close()  # waits for the writes
    plan = build_plan(split_by_marker(tokens, MARKER), tokens, side.hasher, 0, lambda kind, hs: [False] * len(hs))
    refs = {b.tokens.start: side.view.space.key(KeyKind.CHUNK_REF, b.block_hash) for b in plan.blocks if b.chunk_start > 0}
    store = create_store("UcmNfsStore", {"storage_backends": str(store_dir)})
    return dict(zip(refs, store.lookup(list(refs.values()))))


def test_no_reference_is_written_to_exact_blocks_that_were_not_stored(tmp_path):
    """The exact block [16, 20) failed to store: the references into it (blocks (13, 4) and
    (17, 2) of a) are never written; those into stored blocks are."""
    side = side_for(tmp_path, admission=STORE_ALL)
    a = prompt(1)
    _computed_in_full(side, "a", a, failed={side.view.space.key(KeyKind.EXACT, request(side, "x", a).block_hashes[4])})
    assert _stored_refs(side, a, tmp_path / "store") == {6: True, 10: True, 13: False, 17: False}


def test_a_request_whose_load_failed_leaves_no_reference(tmp_path):
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path)
    a = request(side, "a", prompt(1))
    side.get_num_new_matched_tokens(a, 0)
    meta, _ = step(side, [admit(side, a, 0)], {"a": len(a.prompt_token_ids)})
    refused = {d.key for r in meta.requests for d in r.dumps}
    side.take_report(UCMWorkerReport(load_failed={"a"}, not_stored=refused))  # the worker refused its dumps
    step(side, [], {})
    assert not any(_stored_refs(side, a.prompt_token_ids, tmp_path / "store").values())


def test_a_request_waits_a_little_for_references_this_engine_is_about_to_write(tmp_path):
    side = side_for(tmp_path, admission=STORE_ALL)
    a = prompt(1)
    req = request(side, "a", a)
    side.get_num_new_matched_tokens(req, 0)
    meta, _ = step(side, [admit(side, req, 0)], {"a": len(a)})
    _worker_stores(side, [d for r in meta.requests for d in r.dumps])  # confirmed; written at the next step
    b = request(side, "b", a[0:6] + a[13:19] + a[6:13] + a[19:])
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    assert side.stats.data["dump_waits"] == 1


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_kv_role_consumer_loads_only_and_producer_stores_only(tmp_path, role):
    side = side_for(tmp_path, kv_role=role, admission=STORE_ALL)
    stored = prompt(1)
    store_chunks(side, stored)
    a = request(side, "a", stored)  # every chunk block stored: a consumer blends it
    b = request(side, "b", prompt(2))  # nothing stored: a producer stores it
    external = side.get_num_new_matched_tokens(a, 0)[0]
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    meta, _ = step(side, [admit(side, a, external), admit(side, b, 0)], {"a": len(stored) - external, "b": 22})
    steps = {r.req_id: r for r in meta.requests}
    if role == "kv_consumer":
        assert external == len(stored) - 1 and steps["a"].blend is not None
        assert not any(r.dumps for r in meta.requests)
    else:
        assert external == 0 and not any(r.blend or r.chunk_loads or r.prefix_loads for r in meta.requests)
        assert steps["b"].dumps and steps["a"].dumps  # a's exact prefix blocks were never stored


def test_an_unknown_kv_role_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_role must be one of kv_both, kv_producer, kv_consumer"):
        side_for(tmp_path, kv_role="kv_reader")


def test_only_reused_kv_counts_as_cached_in_vllms_prefill_statistics(tmp_path):
    """vLLM sets a request's prefill statistics with every external token as cached just before
    update_state_after_alloc; a blended request's misses, question and recomputed rows are computed."""
    from vllm.v1.metrics.stats import PrefillStats

    side = side_for(tmp_path)  # ratio 0.5
    tokens = prompt(1)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    req.num_preemptions, req.prefill_stats = 0, PrefillStats()
    external, _ = side.get_num_new_matched_tokens(req, 0)
    req.prefill_stats.set(num_prompt_tokens=len(tokens), num_local_cached_tokens=0, num_external_cached_tokens=external)
    admit(side, req, external)
    loaded = 19
    recomputed = -(-loaded // 2)  # ceil(0.5 x 19)
    assert req.prefill_stats.num_cached_tokens == loaded - recomputed
    assert req.prefill_stats.num_computed_tokens == len(tokens) - (loaded - recomputed)


@pytest.mark.parametrize("min_hit_share", [None, 0.0])
def test_a_30k_token_prompt_with_one_cached_chunk_never_makes_a_giant_step(tmp_path, min_hit_share):
    """30,000 tokens, the first 128 a stored chunk: by default too few hits to blend (vLLM prefills
    it in budget-sized chunks); made to blend anyway, its region is cut to the step cap."""
    extra = {} if min_hit_share is None else {"min_hit_share": min_hit_share}
    side = side_for(tmp_path, **extra)  # step budget 64: cap 4 x 64 = 256 rows
    rng = np.random.default_rng(30)
    tokens = [int(t) for t in rng.integers(10, 1000, 127)] + [MARKER] + [int(t) for t in rng.integers(10, 1000, 29872)]
    store_chunks(side, tokens[:128])
    req = request(side, "long", tokens)
    external, _ = side.get_num_new_matched_tokens(req, 0)
    new = admit(side, req, external)
    meta, _ = step(side, [new], {"long": 64})
    report = side.request_finished(req)["ucm"]
    if min_hit_share is None:
        assert external == 0 and not report["blended"] and report["fallback"] == "few_hits"
    else:
        (s,) = meta.requests
        work = len(s.blend.token_ids) - 128 + -(-128 // 2)  # misses + ceil(0.5 x loaded)
        assert report["blended"] and report["fallback"] == "region_cut" and work <= side.step_cap == 256


def test_a_plan_made_ahead_is_made_again_once_old(tmp_path, monkeypatch):
    """BlendFirstScheduler plans waiting requests ahead (planned_blend_work); vLLM's own question uses
    that plan while it is fresh, and a new one, which sees chunks stored since, once it is old."""
    import ucm.integration.vllm.connector.scheduler_side as scheduler_side

    side = side_for(tmp_path)
    tokens = prompt(3)
    req = request(side, "a", tokens)
    assert side.planned_blend_work(req) == 0  # nothing stored yet
    store_chunks(side, tokens)
    assert side.planned_blend_work(req) == 0  # the held plan, still fresh
    monkeypatch.setattr(scheduler_side, "HELD_PLAN_SECONDS", 0.0)
    work = side.planned_blend_work(req)  # planned again: its chunks are in the store now
    assert work == side._deferred["a"][1].work > 0
    monkeypatch.setattr(scheduler_side, "HELD_PLAN_SECONDS", 60.0)
    lookups = []
    side.store.lookup = lambda keys, _real=side.store.lookup: lookups.append(keys) or _real(keys)
    assert side.get_num_new_matched_tokens(req, 0) == (len(tokens) - 1, False)
    assert not lookups  # vLLM's question used the fresh plan


def test_a_lookup_that_raises_leaves_the_request_to_vllm_and_stores_nothing(tmp_path, monkeypatch):
    side = side_for(tmp_path)
    tokens = prompt(11)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    original = list(req.block_hashes)
    faults = tmp_path / "faults"
    faults.write_text("lookup")
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.block_hashes == original  # vLLM's prefix cache keys stay its own
    new = admit(side, req, 0)
    meta, _ = step(side, [new], {"a": len(tokens)})
    assert not any(r.dumps or r.blend for r in meta.requests)
    report = side.request_finished(req)["ucm"]
    assert report["fallback"] == "blend_error" and not report["blended"]
    assert side.stats.data["lookup_errors"] == 1 and side.stats.data["blend_fallbacks_blend_error"] == 1


def test_a_blend_error_report_turns_a_blended_request_into_a_fallback(tmp_path):
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path)
    tokens = prompt(12)
    store_chunks(side, tokens)
    req = request(side, "a", tokens)
    first_step(side, req)
    side.take_report(UCMWorkerReport(blend_error={"a"}))
    assert side._dumps(side._states["a"], len(tokens) + 8) == []
    report = side.request_finished(req)["ucm"]
    assert report["fallback"] == "blend_error" and not report["blended"]


def _computed_dumps(side, req_id, tokens, **request_kw):
    """Runs a request with nothing to load through one step that computes its whole prompt; the
    store keys it dumps (the write of its sightings waited for)."""
    req = request(side, req_id, tokens, **request_kw)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0
    meta, _ = step(side, [admit(side, req, 0)], {req_id: len(tokens)})
    _reap_records(side)
    side.last_report = side.request_finished(req)["ucm"]
    return [d.key for r in meta.requests for d in r.dumps]


def _reap_records(side):
    """Waits for the records (sightings, references) the scheduler handed to the store."""
    for task, _, _ in side.view.record_writes:
        side.store.wait(task)
    side.view.reap_record_writes()


def _exact_keys(side, req_id, tokens):
    return {side.view.space.key(KeyKind.EXACT, h) for h in request(side, req_id, tokens).block_hashes}


def test_a_segment_is_stored_on_its_second_sighting_only(tmp_path):
    """admission second_sighting: the first request to compute a chunk records a sighting of it and
    stores none of its KV; the next one (any position, another engine alike) stores it."""
    side = side_for(tmp_path, admission="second_sighting")
    tokens = prompt(1)
    assert _computed_dumps(side, "a", tokens) == []
    assert side.stats.data["sightings_stored"] == 4  # three chunks and the suffix
    assert side.last_report["first_sightings"] == 4 and side.last_report["dumped_blocks"] == 0
    assert side.stats.data["blocks_not_admitted"] == len(tokens) // BS
    chunks = split_by_marker(tokens, MARKER).chunks
    # The first two chunks swapped, a new question: chunks seen before, the suffix not.
    other = tokens[chunks[1].start:chunks[1].end] + tokens[:chunks[1].start] + tokens[chunks[2].start:] [:-3] + [4, 5, 6]
    elsewhere = side_for(tmp_path, admission="second_sighting")  # another engine on the same store
    assert _exact_keys(elsewhere, "b", other) <= set(_computed_dumps(elsewhere, "b", other))  # the whole prompt's exact blocks: each overlaps a chunk seen before
    assert elsewhere.stats.data["sightings_stored"] == 1  # only its suffix was new


def test_a_first_sighting_is_stored_for_an_indexing_request_and_per_tenant(tmp_path):
    side = side_for(tmp_path, admission="second_sighting")
    tokens = prompt(2)
    indexing = tokens[:-3]  # ends with its last chunk: asks nothing
    assert _exact_keys(side, "index", indexing) <= set(_computed_dumps(side, "index", indexing))
    assert "sightings_stored" not in side.stats.data
    marked = request(side, "marked", prompt(3))
    marked.kv_transfer_params = {"ucm_index": True}
    assert side.get_num_new_matched_tokens(marked, 0)[0] == 0 and side._states["marked"].admission is None
    # A tenant's sighting is its own: another tenant's first sighting of the same text stores nothing.
    assert _computed_dumps(side, "t1", prompt(4), cache_salt="tenant-1") == []
    assert _computed_dumps(side, "t2", prompt(4), cache_salt="tenant-2") == []
    assert _computed_dumps(side, "t1-again", prompt(4), cache_salt="tenant-1") != []


def test_first_sighting_policy_stores_everything_computed(tmp_path):
    side = side_for(tmp_path, admission="first_sighting")
    tokens = prompt(5)
    assert _exact_keys(side, "a", tokens) <= set(_computed_dumps(side, "a", tokens))
    assert "sightings_stored" not in side.stats.data and "blocks_not_admitted" not in side.stats.data


def test_adaptive_admission_stores_first_sightings_while_requests_find_their_chunks(tmp_path):
    side = side_for(tmp_path)  # admission "adaptive", the default
    # A new engine assumes reuse: its first requests store what they compute.
    assert _exact_keys(side, "new", prompt(6)) <= set(_computed_dumps(side, "new", prompt(6)))
    for i in range(4):  # requests that find nothing: the evidence says no reuse
        _computed_dumps(side, f"miss-{i}", prompt(20 + i))
    assert _computed_dumps(side, "unseen", prompt(9)) == []  # a first sighting stores nothing now
    tokens = prompt(7)
    store_chunks(side, tokens)
    for i in range(2):  # requests that find every chunk block they look up
        first_step(side, request(side, f"hit-{i}", tokens))
    assert _exact_keys(side, "new-too", prompt(8)) <= set(_computed_dumps(side, "new-too", prompt(8)))


def test_adaptive_admission_counts_a_sighted_chunk_as_reuse(tmp_path):
    """A stream that starts repeating while in second-sighting mode finds sightings, not KV: the
    evidence counts them, so first sightings are stored again from the next request on."""
    from ucm.sparse.blend.admission import EVIDENCE_REQUESTS

    side = side_for(tmp_path)
    misses = EVIDENCE_REQUESTS + 2  # the cold one and the evidence store, then second-sighting mode
    for i in range(misses):
        _computed_dumps(side, f"miss-{i}", prompt(20 + i))
    assert _computed_dumps(side, "unseen", prompt(9)) == []
    # The last miss was only sighted: stored now, and counted as reuse.
    assert _computed_dumps(side, "again", prompt(20 + misses - 1)) != []
    assert _exact_keys(side, "new", prompt(8)) <= set(_computed_dumps(side, "new", prompt(8)))


def test_a_cold_starts_concurrent_lookups_are_no_evidence(tmp_path):
    """Requests planned before any request of the engine finished find nothing on an empty store
    whatever the traffic: each stores what it computes and none counts as evidence; the evidence
    is the lookups made once one has finished."""
    from ucm.sparse.blend.admission import EVIDENCE_REQUESTS

    side = side_for(tmp_path)
    cold = [request(side, f"cold-{i}", prompt(30 + i)) for i in range(EVIDENCE_REQUESTS + 2)]
    for req in cold:  # all in flight at once
        assert side.get_num_new_matched_tokens(req, 0)[0] == 0
        meta, _ = step(side, [admit(side, req, 0)], {req.request_id: len(req.prompt_token_ids)})
        assert [r.dumps for r in meta.requests] != [[]]
    _reap_records(side)
    for req in cold:
        side.request_finished(req)
    for i in range(EVIDENCE_REQUESTS):  # still no evidence when each is planned: stored
        assert _computed_dumps(side, f"miss-{i}", prompt(40 + i)) != []
    assert _computed_dumps(side, "unseen", prompt(9)) == []  # two lookups that could have found: no reuse


def test_a_store_down_on_a_worker_makes_the_schedulers_lookups_miss(tmp_path):
    """A worker whose load timed out counts the store as down and says so in its report: the
    scheduler's lookups, which a mount answering stats but not reads still answers, miss at once
    (counted) instead of planning loads that would fail; once the back-off ends they hit again."""
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, store_extra={"down_backoff_s": 0.3, "down_backoff_max_s": 0.3},
                    admission=STORE_ALL)
    tokens = prompt(9)
    store_chunks(side, tokens)
    side.take_report(UCMWorkerReport(store_down_s=0.3))
    assert side.get_num_new_matched_tokens(request(side, "a", tokens), 0) == (0, False)
    assert side.stats.data["store_down_blocks"] > 0
    time.sleep(0.35)
    assert side.get_num_new_matched_tokens(request(side, "b", tokens), 0) == (21, False)


def test_the_schedulers_store_follows_the_workers_for_a_few_seconds_per_report(tmp_path):
    """A worker reports a minute of back-off left: the scheduler holds its store down for at most
    STORE_DOWN_HOLD_S, renewed by each report while the worker's store stays down, so it is up
    again within that of the worker's (whose back-off may end early when the mount answers)."""
    from ucm.integration.vllm.connector import scheduler_side
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, store_extra={"down_backoff_s": 1, "down_backoff_max_s": 120}, admission=STORE_ALL)
    side.take_report(UCMWorkerReport(store_down_s=60.0))
    assert 0 < side.store.down_for_s() <= scheduler_side.STORE_DOWN_HOLD_S


def test_worker_reports_aggregate_the_longest_store_down_time():
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    merged = UCMWorkerReport(store_down_s=2.0).aggregate(UCMWorkerReport(store_down_s=5.0))
    assert merged.store_down_s == 5.0 and not merged.is_empty()
    assert UCMWorkerReport().is_empty()


def store_exact(side, tokens, num_blocks):
    """Stores the first `num_blocks` blocks of `tokens` as exact KV."""
    hashes = request(side, "x", tokens).block_hashes[:num_blocks]
    keys = [side.view.space.key(KeyKind.EXACT, h) for h in hashes]
    assert all(side.store.wait(side.store.dump(keys, [np.zeros(64 * BS, dtype=np.uint8)] * len(keys),
                                               [BS] * len(keys))))
    return keys


def test_an_exact_prefix_alone_is_read_between_steps(tmp_path):
    """vLLM parks the request (load_kv_async) while its exact blocks are read; the step that starts
    the read is not a sync-load step, and the request's first scheduled step loads nothing again."""
    side = side_for(tmp_path, admission=STORE_ALL)
    side.reads.async_loads = True
    tokens = prompt(1)
    keys = store_exact(side, tokens, 3)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    new = admit(side, req, 12)  # allocated; vLLM schedules nothing for it yet
    meta, out = step(side, [], {})
    (s,) = meta.requests
    assert s.load_async and [ld.key for ld in s.prefix_loads] == keys and [ld.start for ld in s.prefix_loads] == [0, 4, 8]
    assert s.num_scheduled_tokens == 0 and not out.has_sync_kv_loads
    meta, out = step(side, [], {})  # still loading: nothing more to start
    assert not meta.requests
    meta, out = step(side, [new], {"a": len(tokens) - 12})  # received: scheduled from its first computed token
    (s,) = meta.requests
    assert not s.prefix_loads and not s.load_async and not out.has_sync_kv_loads
    assert [d.start for d in s.dumps] == [12, 16]  # the blocks it computes are stored as usual
    assert side.request_finished(req)["ucm"]["external_prefix_tokens"] == 12


@pytest.mark.parametrize("setting", [False, "auto"])
def test_exact_prefix_loads_stay_in_step_when_off_or_while_reads_are_fast(tmp_path, setting):
    side = side_for(tmp_path, admission=STORE_ALL)
    assert side.reads.async_loads == "auto"  # the default
    side.reads.async_loads = setting
    tokens = prompt(1)
    store_exact(side, tokens, 3)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (12, False)
    meta, out = step(side, [admit(side, req, 12)], {"a": len(tokens) - 12})
    (s,) = meta.requests
    assert [ld.start for ld in s.prefix_loads] == [0, 4, 8] and not s.load_async and out.has_sync_kv_loads


def test_auto_reads_exact_prefixes_between_steps_for_a_while_after_a_slow_read(tmp_path, monkeypatch):
    from ucm.integration.vllm.connector import read_ahead
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, admission=STORE_ALL)
    tokens = prompt(1)
    store_exact(side, tokens, 3)
    side.take_report(UCMWorkerReport(store_down_s=0.0))  # no slow read reported
    assert side.get_num_new_matched_tokens(request(side, "a", tokens), 0) == (12, False)
    side.take_report(UCMWorkerReport(slow_read_s=0.2))
    assert side.get_num_new_matched_tokens(request(side, "b", tokens), 0) == (12, True)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + read_ahead.SLOW_READS_HOLD_S + 1)
    assert side.get_num_new_matched_tokens(request(side, "c", tokens), 0) == (12, False)  # the hold has passed


def test_a_request_whose_background_read_failed_stores_nothing(tmp_path):
    """The worker reported the read failed (vLLM computes from the failed block): nothing of the
    request is dumped afterwards, as after a failed load inside a step."""
    from ucm.integration.vllm.connector.metadata import UCMWorkerReport

    side = side_for(tmp_path, admission=STORE_ALL)
    side.reads.async_loads = True
    tokens = prompt(1)
    store_exact(side, tokens, 3)
    req = request(side, "a", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    new = admit(side, req, 12)
    step(side, [], {})
    side.take_report(UCMWorkerReport(load_failed={"a"}))
    new.num_computed_tokens = 4  # truncated to before the failed block
    meta, _ = step(side, [new], {"a": len(tokens) - 4})
    assert not any(r.dumps or r.prefix_loads for r in meta.requests)


@pytest.mark.parametrize("knobs,configured,expected", [
    ({}, 0.0, 0.0), ({}, 0.03, 0.03), ({"ucm_kv_shift_sample": 0.05}, 0.0, 0.05),
    ({"ucm_kv_shift_sample": 0}, 0.03, 0.0),
    # refused with a warning: the configured value
    ({"ucm_kv_shift_sample": 0.9}, 0.03, 0.03), ({"ucm_kv_shift_sample": "x"}, 0.0, 0.0),
])
def test_kv_shift_sample_per_request(tmp_path, monkeypatch, knobs, configured, expected):
    region, report = _blended_with(tmp_path, monkeypatch, knobs, kv_shift_sample=configured)
    assert region.kv_shift_sample == expected and report["kv_shift_sample"] == expected
