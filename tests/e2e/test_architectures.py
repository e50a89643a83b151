"""Qwen2 and Qwen3 (q/k norm before RoPE): tiny random-weight models pass the ratio-1.0 identity.

Each model gets one engine with Blend; the reference is the same engine computing the prompt
normally (Blend off for the request, and a cache salt so vLLM's prefix cache cannot serve it).
Dummy weights are seeded, so the outputs are deterministic.
"""

import json
import shutil

import pytest
from blend_helpers import assert_same, run
from ucm.integration.vllm.llm import ucm_transfer_config

TINY = {
    "Qwen2ForCausalLM": {"model_type": "qwen2"},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "head_dim": 64},
}


def tiny_model(model_dir, tmp_path, arch):
    out = tmp_path / arch
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    config = {
        "architectures": [arch], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 49152, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        **TINY[arch],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("arch", sorted(TINY))
def test_ratio_one_identity(arch, model_dir, tmp_path, engine_factory):
    path = tiny_model(model_dir, tmp_path, arch)
    llm = engine_factory(path, load_format="dummy", max_model_len=4096,
                         kv_transfer_config=ucm_transfer_config(tmp_path / "store", blend_ratio=0.15))
    passages = [[1000 + 7 * i + j for j in range(150 + 40 * i)] + [2] for i in range(3)]
    question = [500 + j for j in range(12)]
    first = [t for p in passages for t in p] + question
    reordered = [t for p in passages[::-1] for t in p] + question
    run(llm, first)
    blended = run(llm, reordered, ratio=1.0)
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 400
    reference = run(llm, reordered, cache_salt="reference", disable=True)
    assert not reference.report["blended"]
    assert_same(blended, reference)
    reuse = run(llm, reordered, ratio=0.0)  # the blocks blended above never serve it
    assert reuse.report["blended"]
