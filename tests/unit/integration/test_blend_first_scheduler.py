"""BlendFirstScheduler step by step: vLLM's real Scheduler and the UCM connector's scheduler half on
a real store directory, with no model forward (schedule() alone advances prefills). A request
"blends" when its chunk blocks are in the store: they are written here under the keys the
connector looks up (their bytes are never read: nothing is loaded without a worker)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import ucm.integration.vllm.connector.blend_first_scheduler as bfs  # noqa: E402
from ucm.integration.vllm.llm import ucm_transfer_config  # noqa: E402
from ucm.sparse.blend.chunking import split_by_marker  # noqa: E402
from ucm.sparse.blend.plan import build_plan  # noqa: E402
from ucm.store.keys import KeyKind  # noqa: E402

BS, BUDGET, MARKER = 16, 256, 2
STORE_ALL = {"admission": "first_sighting"}  # every computed block stored on first sighting


@pytest.fixture
def make_scheduler(model_dir, tmp_path):
    made = []
    yield lambda **kw: made.append(new_scheduler(model_dir, tmp_path, **kw)) or made[-1]
    for sched in made:
        sched.shutdown()


@pytest.fixture
def scheduler(make_scheduler):
    return make_scheduler()


def new_scheduler(model_dir, tmp_path, num_blocks=2000, max_num_seqs=8, budget=BUDGET, **transfer):
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers UCMConnector, as in every vLLM process

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=4096, seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=ucm_transfer_config(tmp_path / "store", blend_ratio=0.15, **transfer))
    hf = vllm_config.model_config.hf_text_config
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.hidden_size // hf.num_attention_heads, dtype=torch.float32)
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = bfs.BlendFirstScheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                    structured_output_manager=StructuredOutputManager(vllm_config), block_size=BS,
                                    log_stats=True)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sched.block_hasher = get_request_block_hasher(BS, hash_fn)
    return sched


def prompt(seed: int, chunks: int = 4, words: int = 95) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for _ in range(chunks) for t in [*rng.integers(100, 20000, words), MARKER]] + [7, 8, 9]


def add(sched, req_id: str, tokens: list[int], **kw) -> Request:
    request = Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=sched.block_hasher, **kw)
    sched.add_request(request)
    return request


def store_chunks(sched, tokens: list[int], kind: KeyKind = KeyKind.CHUNK) -> None:
    """Writes the prompt's chunk blocks where the connector looks them up."""
    side = sched.connector.scheduler_side
    plan = build_plan(split_by_marker(tokens, MARKER), tokens, side.hasher, 0, lambda kind, hs: [False] * len(hs),
                      None)
    keys = [side.view.space.key(kind, b.block_hash) for b in plan.blocks]
    assert all(side.store.wait(side.store.dump(keys, [np.zeros(64, np.uint8)] * len(keys), [len(b.tokens) for b in plan.blocks])))


def counters(sched) -> dict:
    """The connector's counts: those vLLM took in update_from_output (step below) and those since."""
    counts = dict(getattr(sched, "taken_counts", {}))
    for name, value in sched.connector.scheduler_side.stats.data.items():
        counts[name] = counts.get(name, 0) + value
    return counts


def test_a_blend_request_goes_before_the_waiting_queue_and_the_prefills_keep_one_token(scheduler):
    blend_tokens = prompt(1)
    store_chunks(scheduler, blend_tokens)
    add(scheduler, "long", prompt(2, chunks=12))
    assert scheduler.schedule().num_scheduled_tokens == {"long": BUDGET}
    add(scheduler, "cold", prompt(3))
    add(scheduler, "blend", blend_tokens)

    out = scheduler.schedule()
    assert out.num_scheduled_tokens["blend"] >= 1
    assert out.num_scheduled_tokens["long"] == bfs.BLEND_STEP_SHARE
    assert out.num_scheduled_tokens.get("cold", 0) <= bfs.BLEND_STEP_SHARE
    assert counters(scheduler)["blend_first_steps"] == 1 and counters(scheduler)["blend_first_reorders"] == 1

    out = scheduler.schedule()  # nothing waits to blend: vLLM's own step
    assert out.num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE
    assert counters(scheduler)["blend_first_steps"] == 1


def test_vllm_alone_keeps_the_blend_request_behind_the_queue(scheduler, monkeypatch):
    """The behaviour the scheduler changes, on the same inputs."""
    monkeypatch.setattr(bfs.BlendFirstScheduler, "_blend_request_first", lambda self: False)
    blend_tokens = prompt(1)
    store_chunks(scheduler, blend_tokens)
    add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    add(scheduler, "cold", prompt(3))
    add(scheduler, "blend", blend_tokens)
    out = scheduler.schedule()
    assert "blend" not in out.num_scheduled_tokens and out.num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE


def test_a_blend_request_with_a_long_region_keeps_its_place(scheduler):
    """Half its chunks hit: its region (misses and recomputed rows) runs more rows than vLLM's
    step budget, so it is no short job and waits behind the queue as under vLLM's scheduler; a
    request behind it with every chunk hit still goes first."""
    mixed = prompt(1, chunks=8)
    store_chunks(scheduler, prompt(1, chunks=4))  # the first 4 of its 8 chunks
    add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    add(scheduler, "cold", prompt(3))
    mixed_req = add(scheduler, "mixed", mixed)
    assert scheduler.connector.scheduler_side.planned_blend_work(mixed_req) > BUDGET * bfs.SHORT_REGION_BUDGETS
    out = scheduler.schedule()
    assert "mixed" not in out.num_scheduled_tokens and out.num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE
    hit_tokens = prompt(4)
    store_chunks(scheduler, hit_tokens)
    add(scheduler, "hit", hit_tokens)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["hit"] >= 1 and out.num_scheduled_tokens["long"] == bfs.BLEND_STEP_SHARE
    assert "mixed" not in out.num_scheduled_tokens


def test_a_long_region_waits_for_a_running_prefill_that_ends_sooner(scheduler):
    """A prefill with 35 tokens left and a region of ~450 rows at the head of the queue: vLLM would
    admit the region into the prefill's last step (221 tokens of budget left), so the prefill's
    first token would wait for the whole region. Held, the prefill ends alone; then the region."""
    mixed = prompt(1, chunks=8)
    store_chunks(scheduler, prompt(1, chunks=4))
    add(scheduler, "short", prompt(2, chunks=3))  # 291 tokens: 256, then 35
    assert scheduler.schedule().num_scheduled_tokens == {"short": BUDGET}
    mixed_req = add(scheduler, "mixed", mixed)
    assert scheduler.connector.scheduler_side.planned_blend_work(mixed_req) > 35 + BUDGET
    assert scheduler.schedule().num_scheduled_tokens == {"short": 35}
    assert counters(scheduler)["blend_holds"] == 1
    out = scheduler.schedule()  # the prefill is done: the region goes
    assert out.num_scheduled_tokens["mixed"] >= 1 and out.num_scheduled_tokens.get("short", 0) <= 1
    assert counters(scheduler)["blend_holds"] == 1


def test_a_region_shorter_than_what_the_prefill_has_left_is_not_held(scheduler, monkeypatch):
    """SHORT_REGION_BUDGETS lowered so that the region is no short job: against a prefill with more
    tokens left than its rows it keeps its place as under vLLM's scheduler, with no held step."""
    monkeypatch.setattr(bfs, "SHORT_REGION_BUDGETS", 0.1)
    hit = prompt(4)
    store_chunks(scheduler, hit)
    add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    hit_req = add(scheduler, "hit", hit)
    assert BUDGET * 0.1 < scheduler.connector.scheduler_side.planned_blend_work(hit_req) < 899
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE and "blend_holds" not in counters(scheduler)


def test_held_steps_in_a_row_are_bounded(scheduler, monkeypatch):
    monkeypatch.setattr(bfs, "MAX_HELD_STEPS_IN_ROW", 1)
    mixed = prompt(1, chunks=8)
    store_chunks(scheduler, prompt(1, chunks=4))
    add(scheduler, "long", prompt(2, chunks=4))  # 387 tokens, fewer than the region's rows
    mixed_req = add(scheduler, "mixed", mixed)  # vLLM would admit it into the prefill's first step
    assert scheduler.connector.scheduler_side.planned_blend_work(mixed_req) > 387
    assert "mixed" not in scheduler.schedule().num_scheduled_tokens
    assert counters(scheduler)["blend_holds"] == 1
    out = scheduler.schedule()  # the second step in a row: not held, although the prefill runs
    assert "mixed" in out.num_scheduled_tokens and "long" in out.num_scheduled_tokens


def test_short_steps_in_a_row_are_bounded(scheduler, monkeypatch):
    monkeypatch.setattr(bfs, "MAX_PASSES_PER_PREFILL", 100)
    add(scheduler, "long", prompt(2, chunks=40))
    scheduler.schedule()
    shares = []
    for i in range(bfs.MAX_SHORT_STEPS_IN_ROW + 2):  # a new blend request before every step
        tokens = prompt(10 + i)
        store_chunks(scheduler, tokens)
        add(scheduler, f"blend{i}", tokens)
        shares.append(scheduler.schedule().num_scheduled_tokens["long"])
    assert shares[:bfs.MAX_SHORT_STEPS_IN_ROW] == [bfs.BLEND_STEP_SHARE] * bfs.MAX_SHORT_STEPS_IN_ROW
    assert shares[-2] > bfs.BLEND_STEP_SHARE  # the prefill's own step, although a blend request waits
    assert shares[-1] == bfs.BLEND_STEP_SHARE  # and then short again


def test_a_prefill_is_passed_by_one_blend_request_and_the_next_waits_its_turn(scheduler):
    """Two blend requests arrive while a long prefill runs: the first goes before it, the second
    neither goes before it nor joins its steps (the prefill gets vLLM's budget alone) until that
    prefill's prompt is done; then it goes first again, before a prefill that arrived meanwhile."""
    tokens = [prompt(10 + i) for i in range(3)]
    for t in tokens:
        store_chunks(scheduler, t)
    long_req = add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    add(scheduler, "blend0", tokens[0])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["long"] == bfs.BLEND_STEP_SHARE and "blend0" in out.num_scheduled_tokens
    add(scheduler, "blend1", tokens[1])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE and "blend1" not in out.num_scheduled_tokens
    assert counters(scheduler)["blend_first_yields"] == 1 and counters(scheduler)["blend_first_steps"] == 1
    add(scheduler, "cold", prompt(3))
    while long_req.num_computed_tokens < long_req.num_prompt_tokens:
        out = scheduler.schedule()
        assert "blend1" not in out.num_scheduled_tokens
    out = scheduler.schedule()  # blend1 goes before the prefill that arrived after it
    assert "blend1" in out.num_scheduled_tokens and out.num_scheduled_tokens.get("cold", 0) <= bfs.BLEND_STEP_SHARE
    assert counters(scheduler)["blend_first_steps"] == 2


def test_with_the_bound_lifted_the_second_blend_request_passes_too(scheduler, monkeypatch):
    """Without the bound the second blend request passes the prefill too."""
    monkeypatch.setattr(bfs, "MAX_PASSES_PER_PREFILL", 2)
    tokens = [prompt(10 + i) for i in range(2)]
    for t in tokens:
        store_chunks(scheduler, t)
    add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    for i, t in enumerate(tokens):
        add(scheduler, f"blend{i}", t)
        out = scheduler.schedule()
        assert out.num_scheduled_tokens["long"] == bfs.BLEND_STEP_SHARE and f"blend{i}" in out.num_scheduled_tokens
    assert "blend_first_yields" not in counters(scheduler)


def test_a_blend_request_not_admitted_in_its_short_step_gets_no_second_one(make_scheduler):
    # vLLM admits a request when its whole prompt's blocks are free: the long prefill (291 tokens,
    # 19 blocks) fits, the blend request (387 tokens, 25 blocks) does not beside its first 17.
    scheduler = make_scheduler(num_blocks=1 + 40)
    blend_tokens = prompt(1)
    store_chunks(scheduler, blend_tokens)
    add(scheduler, "long", prompt(2, chunks=3))
    assert scheduler.schedule().num_scheduled_tokens == {"long": BUDGET}
    add(scheduler, "blend", blend_tokens)
    assert scheduler.schedule().num_scheduled_tokens == {"long": bfs.BLEND_STEP_SHARE}  # no blocks for "blend"
    assert scheduler.schedule().num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE  # vLLM's own step
    assert counters(scheduler)["blend_first_steps"] == 1


def test_no_short_step_while_vllm_admits_no_more_requests(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    blend_tokens = prompt(1)
    store_chunks(scheduler, blend_tokens)
    add(scheduler, "long", prompt(2, chunks=12))
    scheduler.schedule()
    add(scheduler, "blend", blend_tokens)
    assert scheduler.schedule().num_scheduled_tokens["long"] > bfs.BLEND_STEP_SHARE
    assert "blend_first_steps" not in counters(scheduler)


# ---- chunks computed alone in the background ---------------------------------------------


def step(sched) -> tuple[dict[str, int], list[str]]:
    """One scheduler step with the model's part played here: every request whose prompt is done
    samples token 7. Returns the tokens scheduled per request and the request ids clients see."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens else []
               for r in ids]
    outputs = sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                              sampled_token_ids=sampled))
    taken = sched.__dict__.setdefault("taken_counts", {})
    for engine_outputs in outputs.values():
        for name, value in (engine_outputs.scheduler_stats.kv_connector_stats or {}).items():
            taken[name] = taken.get(name, 0) + value
    return out.num_scheduled_tokens, [o.request_id for eo in outputs.values() for o in eo.outputs]


def background(sched) -> list[Request]:
    return [r for r in sched.requests.values() if r.request_id.startswith("ucm-background-") and not r.is_finished()]


def run_to_end(sched, request: Request) -> None:
    for _ in range(100):
        if request.is_finished():
            return
        step(sched)
    raise AssertionError(f"{request.request_id} did not finish")


def test_missed_chunks_are_computed_alone_while_no_user_request_is_in_the_engine(make_scheduler):
    sched = make_scheduler(chunk_store="alone", blend_options={"admission": "second_sighting"})
    tokens = prompt(1)
    chunks = split_by_marker(tokens, MARKER).chunks
    run_to_end(sched, add(sched, "first", tokens, cache_salt="tenant-a"))
    # Its first sighting: recorded, nothing stored, nothing computed alone.
    assert not background(sched) and "background_chunks_queued" not in counters(sched)
    assert sched.reset_prefix_cache()  # the second sighting, as on another instance
    run_to_end(sched, add(sched, "user", tokens, cache_salt="tenant-a"))

    (chunk,) = background(sched)  # chunks 1-3 missed (chunk 0 opens the prompt: stored as its prefix)
    assert chunk.prompt_token_ids == tokens[chunks[1].start:chunks[1].end]
    assert chunk.cache_salt == "tenant-a"
    assert counters(sched)["background_chunks_queued"] == 3 and counters(sched)["background_chunks_started"] == 1
    scheduled, seen = step(sched)
    assert scheduled == {chunk.request_id: len(chunk.prompt_token_ids)} and seen == []  # <= 256: one step
    assert chunk.is_finished() and counters(sched)["background_chunks_computed"] == 1
    (second,) = background(sched)
    assert second.prompt_token_ids == tokens[chunks[2].start:chunks[2].end]


def test_background_steps_are_short_and_a_user_request_stops_them(make_scheduler):
    sched = make_scheduler(chunk_store="alone", blend_options=STORE_ALL, budget=1024)
    tokens = prompt(1, words=400)  # chunks of 401 tokens: two background steps each
    run_to_end(sched, add(sched, "user", tokens))
    (chunk,) = background(sched)
    scheduled, _ = step(sched)
    assert scheduled == {chunk.request_id: bfs.BACKGROUND_STEP_TOKENS}

    user = add(sched, "next", prompt(2))
    assert chunk.is_finished() and not background(sched) and counters(sched)["background_chunks_stopped"] == 1
    scheduled, _ = step(sched)
    assert scheduled == {"next": len(user.prompt_token_ids)}  # vLLM's whole budget again
    run_to_end(sched, user)
    (again,) = background(sched)  # the stopped chunk goes first
    assert again.prompt_token_ids == chunk.prompt_token_ids and again.request_id != chunk.request_id


def test_a_chunk_stored_meanwhile_is_not_computed_and_any_policy_queues_nothing(make_scheduler):
    sched = make_scheduler(chunk_store="alone", blend_options=STORE_ALL)
    tokens = prompt(1)  # 387 tokens: two steps
    chunks = split_by_marker(tokens, MARKER).chunks
    user = add(sched, "user", tokens)
    step(sched)  # planned: every chunk missed
    # Chunk 1 is stored (as computed alone, by another engine, say) before the user request ends.
    store_chunks(sched, tokens[chunks[1].start:chunks[1].end], KeyKind.EXACT)
    run_to_end(sched, user)
    (started,) = background(sched)
    assert started.prompt_token_ids == tokens[chunks[2].start:chunks[2].end]
    assert counters(sched)["background_chunks_skipped"] == 1

    sched = make_scheduler(blend_options=STORE_ALL)  # "any": a missed chunk is stored from the prompt itself
    run_to_end(sched, add(sched, "user", prompt(3)))
    assert not background(sched) and "background_chunks_queued" not in counters(sched)


def test_a_chunk_its_request_gave_by_length_is_sent_with_its_length(make_scheduler):
    sched = make_scheduler(chunk_store="alone", blend_options=STORE_ALL)
    tokens = prompt(1)
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"ucm_chunk_lengths": [96, 96, 96, 96]}})
    user = Request("user", tokens, params, None, block_hasher=sched.block_hasher)
    sched.add_request(user)
    run_to_end(sched, user)
    (chunk,) = background(sched)
    assert chunk.prompt_token_ids == tokens[96:192] and chunk.kv_transfer_params == {"ucm_chunk_lengths": [96]}
