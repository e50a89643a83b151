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
from blend_helpers import forget_local_prefix_cache, params, prompts, result, run

from ucm.eval.metrics import short_answer
from ucm.integration.vllm.llm import shutdown, ucm_transfer_config

BF16_LOGPROB_TOL = 0.05


def assert_close_bf16(a, b):
    """Same greedy tokens; the first token's logprob (prefill alone) within 0.05. Later ones within
    0.15: in bfloat16 two full prefills of the same prompt on engines of different cache sizes
    already differ by up to 0.09 at the fourth token (measured), decode compounding the rounding."""
    assert a.tokens == b.tokens
    assert abs(a.logprobs[0] - b.logprobs[0]) < BF16_LOGPROB_TOL, (a.logprobs, b.logprobs)
    assert all(abs(x - y) < 0.15 for x, y in zip(a.logprobs, b.logprobs)), (a.logprobs, b.logprobs)


@pytest.fixture(scope="module")
def blend_bf16(model_dir, tmp_path_factory, monkeypatch_module):
    """One bfloat16 engine with Blend; the reference is the same engine with Blend turned off for
    the request (full prefill) and its own cache salt. A small KV cache: the session's two
    float32 engines are alive too, and a fourth engine would not fit in 24 GiB."""
    from ucm.integration.vllm.llm import make_llm

    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # read by the engine processes at start
    store = tmp_path_factory.mktemp("ucm-store-bf16")
    llm = make_llm(str(model_dir), dtype="bfloat16", kv_transfer_config=ucm_transfer_config(store, blend_ratio=0.15),
                   enforce_eager=True)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def full_prefill(llm, token_ids, salt):
    ref = run(llm, token_ids, cache_salt=f"reference-{salt}", disable=True)
    assert not ref.report["blended"]  # chunks may be found; none is loaded
    return ref


# How far Blend over exact KV may move the first token's logprob, in units of this host's bfloat16
# noise floor (below). Measured on 6 generated prompts (seeds 301-306), on a CPU with AVX512-BF16
# and again with oneDNN and ATen held to AVX-512F (ONEDNN_MAX_CPU_ISA=AVX512_CORE
# ATEN_CPU_CAPABILITY=avx512, as on CPUs that emulate bfloat16): the 30%-recompute difference was
# 0.0004-0.14, the floor 0.01-0.08, their ratio at most 4.7. A fixed 0.05 failed on both.
NOISE_FLOOR_FACTOR = 5.0


def bf16_noise_floor(llm, token_ids, other, salt) -> tuple[float, float]:
    """This host's bfloat16 noise on the first token's logprob, measured two ways against dense
    prefill of ``token_ids`` alone: dense prefill of it batched with ``other`` (another batch
    shape: other GEMM blockings and roundings) and full reuse of its stored KV (ratio 0: the
    rounding of the stored, twice-rotated keys alone). Returns (floor, dense logprob)."""
    dense = full_prefill(llm, token_ids, salt)
    outs = llm.generate([{"prompt_token_ids": list(token_ids), "cache_salt": f"batched-{salt}"},
                         {"prompt_token_ids": list(other), "cache_salt": f"batched-other-{salt}"}],
                        params(disable=True), use_tqdm=False)
    batched = result(outs[0])
    forget_local_prefix_cache(llm)
    reused = run(llm, token_ids, ratio=0.0, exact_prefix=False)
    assert reused.report["blended"]
    floor = max(abs(batched.logprobs[0] - dense.logprobs[0]), abs(reused.logprobs[0] - dense.logprobs[0]))
    return floor, dense


def test_reloaded_kv_with_scattered_recompute_matches_full_prefill(blend_bf16):
    """A prompt's own KV reloaded at its own positions, 30% recomputed: full prefill's greedy
    tokens, the first logprob within a multiple of the bfloat16 noise measured on this host."""
    a, b = prompts(blend_bf16, seed=301)
    run(blend_bf16, a)
    forget_local_prefix_cache(blend_bf16)
    again = run(blend_bf16, a, ratio=0.3, exact_prefix=False)
    assert again.report["blended"] and again.report["chunk_hit_tokens"] > 0.5 * len(a)
    floor, dense = bf16_noise_floor(blend_bf16, a, b, 301)
    assert again.tokens == dense.tokens
    tol = NOISE_FLOOR_FACTOR * floor
    assert abs(again.logprobs[0] - dense.logprobs[0]) <= tol, (again.logprobs, dense.logprobs, floor)


def test_reordered_chunks_at_ratio_one_match_full_prefill(blend_bf16):
    """Chunks stored in one order and loaded in another (delta-RoPE), every loaded token
    recomputed from the check layer on: full prefill of the reordered prompt."""
    a, b = prompts(blend_bf16, seed=302)
    run(blend_bf16, a)
    blended = run(blend_bf16, b, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 0.5 * len(b)
    assert_close_bf16(blended, full_prefill(blend_bf16, b, 302))


def test_blend_at_default_ratio_answers_like_full_prefill(blend_bf16):
    """The default ratio over reordered chunks: approximate KV, so the greedy answers are compared
    as the benchmarks compare them, by their first sentence (this prompt's, " falconer.", is
    stable under Blend in float32 and bfloat16; what follows it is not)."""
    a, b = prompts(blend_bf16, seed=303)
    run(blend_bf16, a)
    blended = run(blend_bf16, b)
    assert blended.report["blended"] and blended.report["ratio"] == pytest.approx(0.15)
    full = full_prefill(blend_bf16, b, 303)
    tok = blend_bf16.get_tokenizer()
    answers = [short_answer(tok.decode(r.tokens, skip_special_tokens=True)) for r in (blended, full)]
    assert answers[1] and answers[0] == answers[1], answers
