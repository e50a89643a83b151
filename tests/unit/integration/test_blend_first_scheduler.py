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
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import ucm.integration.vllm.connector.blend_first_scheduler as bfs  # noqa: E402
from ucm.integration.vllm.llm import ucm_transfer_config  # noqa: E402
from ucm.sparse.blend.chunking import split_by_marker  # noqa: E402
from ucm.sparse.blend.plan import build_plan  # noqa: E402
from ucm.store.keys import KeyKind  # noqa: E402

BS, BUDGET, MARKER = 16, 256, 2


@pytest.fixture
def make_scheduler(model_dir, tmp_path):
    made = []
    yield lambda **kw: made.append(new_scheduler(model_dir, tmp_path, **kw)) or made[-1]
    for sched in made:
        sched.shutdown()


@pytest.fixture
def scheduler(make_scheduler):
    return make_scheduler()


def new_scheduler(model_dir, tmp_path, num_blocks=2000, max_num_seqs=8):
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers UCMConnector, as in every vLLM process

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=4096, seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET, max_model_len=4096,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=ucm_transfer_config(tmp_path / "store", blend_ratio=0.15))
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


def add(sched, req_id: str, tokens: list[int]) -> Request:
    request = Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=sched.block_hasher)
    sched.add_request(request)
    return request


def store_chunks(sched, tokens: list[int]) -> None:
    """Writes the prompt's chunk blocks where the connector looks them up."""
    side = sched.connector.scheduler_side
    plan = build_plan(split_by_marker(tokens, MARKER), tokens, side.hasher, 0, lambda kind, hs: [False] * len(hs),
                      None)
    keys = [side.key(KeyKind.CHUNK, b.block_hash) for b in plan.blocks]
    assert all(side.store.wait(side.store.dump(keys, [np.zeros(64, np.uint8)] * len(keys), [len(b.tokens) for b in plan.blocks])))


def counters(sched) -> dict:
    return sched.connector.scheduler_side.stats.data


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


def test_short_steps_in_a_row_are_bounded(scheduler):
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
