"""Model identity by content (issue 38), through real engines on one store directory: two
random-weight models in directories of the same name share no KV, and one model at two paths
(under another directory name too) does. Three engine starts, one after the other."""

from __future__ import annotations

import json
import shutil

import torch
from blend_helpers import assert_same, run

from ucm.integration.vllm.llm import shutdown, ucm_transfer_config

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 512, 49152  # head size 64


def tiny_llama(model_dir, out, seed: int):
    """A 2-layer Llama with random weights in a real safetensors file, and the embedded model's tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "vocab_size": VOCAB, "tie_word_embeddings": True, "hidden_act": "silu",
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    head = HIDDEN // HEADS

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).contiguous()

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
                    p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, FFN), p + "input_layernorm.weight": torch.ones(HIDDEN),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_kv_shared_by_content_not_by_directory_name(model_dir, tmp_path, engine_factory, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    first_model = tiny_llama(model_dir, tmp_path / "a" / "m", seed=1)
    other_model = tiny_llama(model_dir, tmp_path / "b" / "m", seed=2)  # same directory name, other weights
    same_model = shutil.copytree(first_model, tmp_path / "mnt" / "renamed")  # same weights, other path and name
    config = ucm_transfer_config(tmp_path / "store")
    prompt = [1000 + 7 * i for i in range(300)]  # two full 128-token blocks and a tail

    one = engine_factory(first_model, kv_transfer_config=config, max_model_len=2048)
    first = run(one, prompt)
    assert first.report["external_prefix_tokens"] == 0 and first.report["dumped_blocks"] == 2
    shutdown(one)  # its worker finishes pending dumps on shutdown

    other = engine_factory(other_model, kv_transfer_config=config, max_model_len=2048)
    assert run(other, prompt).report["external_prefix_tokens"] == 0  # the first model's KV is not its own
    shutdown(other)

    same = engine_factory(same_model, kv_transfer_config=config, max_model_len=2048)
    loaded = run(same, prompt)
    assert loaded.report["external_prefix_tokens"] == 256
    assert_same(loaded, first)
