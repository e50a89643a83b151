"""Blend on a bfloat16 engine against bfloat16 full prefill.

bfloat16 is the fast dense dtype on CPUs with AMX (vLLM then packs the KV cache in VNNI tiles,
ISA 'amx') and on some without; elsewhere vLLM keeps its 'vec' layout. Either way this runs the
whole bfloat16 path: loads (delta-RoPE in float32, one rounding), the layout of whichever ISA
vLLM picked on this host, the native kernel over bfloat16 pages and the subset pass. Stored K
is rotated twice (to chunk-local positions and back), each time rounded to bfloat16, so reloaded
KV is no longer bit-exact: logprobs are compared within a bfloat16-sized tolerance.
"""

from __future__ import annotations

import pytest
from blend_helpers import assert_same, prompts, run

from ucm.integration.vllm.llm import shutdown, ucm_transfer_config

BF16_LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def plain_bf16(model_dir):
    from ucm.integration.vllm.llm import make_llm

    llm = make_llm(str(model_dir), dtype="bfloat16")
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def blend_bf16(model_dir, tmp_path_factory):
    from ucm.integration.vllm.llm import make_llm

    store = tmp_path_factory.mktemp("ucm-store-bf16")
    llm = make_llm(str(model_dir), dtype="bfloat16", kv_transfer_config=ucm_transfer_config(store, blend_ratio=0.15))
    yield llm
    shutdown(llm)


def test_reloaded_kv_with_scattered_recompute_matches_full_prefill(blend_bf16, plain_bf16):
    """A prompt's own KV reloaded at its own positions, 30% recomputed: full prefill up to bfloat16
    rounding of the stored keys."""
    a, _ = prompts(blend_bf16, seed=301)
    run(blend_bf16, a)
    again = run(blend_bf16, a, cache_salt="fresh", ratio=0.3)
    assert again.report["blended"] and again.report["chunk_hit_tokens"] > 0.5 * len(a)
    assert_same(again, run(plain_bf16, a), tol=BF16_LOGPROB_TOL)


def test_reordered_chunks_at_ratio_one_match_full_prefill(blend_bf16, plain_bf16):
    """Chunks stored in one order and loaded in another (delta-RoPE), every loaded token
    recomputed from the check layer on: full prefill of the reordered prompt."""
    a, b = prompts(blend_bf16, seed=302)
    run(blend_bf16, a)
    blended = run(blend_bf16, b, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 0.5 * len(b)
    assert_same(blended, run(plain_bf16, b), tol=BF16_LOGPROB_TOL)


def test_blend_at_default_ratio_answers_like_full_prefill(blend_bf16, plain_bf16):
    """The default ratio over reordered chunks: approximate KV, so only the greedy answer's first
    tokens are compared (this prompt's answer is stable under Blend in float32 and bfloat16)."""
    a, b = prompts(blend_bf16, seed=303)
    run(blend_bf16, a)
    blended = run(blend_bf16, b)
    assert blended.report["blended"] and blended.report["ratio"] == pytest.approx(0.15)
    assert blended.tokens[:4] == run(plain_bf16, b).tokens[:4]
