"""Model identity by content (issue 38): the store namespace follows a model's config.json and
weight files, not its directory's name or path."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from ucm.integration.vllm.connector import model_identity
from ucm.integration.vllm.connector.model_identity import SAMPLE_BYTES, model_digest
from ucm.integration.vllm.connector.ucm_connector import store_namespace

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "torch_dtype": "float32"}


def make_model(path, seed: int, config: dict = CONFIG):
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((128, 64), dtype=np.float32)},
              str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_same_directory_name_different_weights(tmp_path):
    a = make_model(tmp_path / "a" / "m", seed=1)
    b = make_model(tmp_path / "b" / "m", seed=2)
    assert model_digest(str(a)) != model_digest(str(b))
    assert len(model_digest(str(a))) == 32 and int(model_digest(str(a)), 16) >= 0


def test_same_model_at_two_paths(tmp_path):
    a = make_model(tmp_path / "a" / "m", seed=1)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "other-name")
    assert model_digest(str(a)) == model_digest(str(copy)) == model_digest(str(a) + "/")
    # Files that are not config or weights do not count (tokenizer: store keys hash token ids).
    (copy / "tokenizer.json").write_text('{"changed": true}')
    (copy / "README.md").write_text("notes")
    assert model_digest(str(copy)) == model_digest(str(a))


def test_config_canonicalised(tmp_path):
    a = make_model(tmp_path / "a" / "m", seed=1)
    b = make_model(tmp_path / "b" / "m", seed=1)
    assert model_digest(str(a)) == model_digest(str(b))  # same seed: same weights
    reordered = dict(reversed(list(CONFIG.items())), _name_or_path=str(b), transformers_version="9.9")
    (b / "config.json").write_text(json.dumps(reordered, separators=(",", ":")))
    assert model_digest(str(a)) == model_digest(str(b))
    (b / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": 500000.0}))
    assert model_digest(str(a)) != model_digest(str(b))


def test_weight_file_name_size_and_set(tmp_path):
    a = make_model(tmp_path / "a" / "m", seed=1)
    base = model_digest(str(a))
    (a / "model.safetensors").rename(a / "model-00001-of-00001.safetensors")
    assert model_digest(str(a)) != base
    (a / "model-00001-of-00001.safetensors").rename(a / "model.safetensors")
    assert model_digest(str(a)) == base
    (a / "extra.bin").write_bytes(b"\0" * 10)
    assert model_digest(str(a)) != base


def test_large_file_head_middle_tail_sampled(tmp_path):
    """Files over 3 MiB are sampled: first, middle and last MiB. A same-size change elsewhere is
    not seen (the documented price of a cheap start-up)."""
    d = tmp_path / "m"
    d.mkdir()
    size = 5 * SAMPLE_BYTES
    data = bytearray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    weights = d / "model.safetensors"

    def digest_with(offset: int) -> str:
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        weights.write_bytes(bytes(changed))
        return model_digest(str(d))

    weights.write_bytes(bytes(data))
    base = model_digest(str(d))
    middle = (size - SAMPLE_BYTES) // 2
    for offset in (0, SAMPLE_BYTES - 1, middle, middle + SAMPLE_BYTES - 1, size - SAMPLE_BYTES, size - 1):
        assert digest_with(offset) != base, offset
    for offset in (SAMPLE_BYTES, middle - 1, middle + SAMPLE_BYTES, size - SAMPLE_BYTES - 1):
        assert digest_with(offset) == base, offset  # between the sampled windows: not detected


def test_small_file_hashed_whole(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    data = bytearray(3 * SAMPLE_BYTES)
    (d / "w.bin").write_bytes(bytes(data))
    base = model_digest(str(d))
    data[SAMPLE_BYTES + 5] = 1
    (d / "w.bin").write_bytes(bytes(data))
    assert model_digest(str(d)) != base


def test_single_weight_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    (tmp_path / "b" / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    assert model_digest(str(tmp_path / "a" / "m.gguf")) == model_digest(str(tmp_path / "b" / "m.gguf"))
    (tmp_path / "b" / "m.gguf").write_bytes(b"GGUF" + b"\2" * 100)
    assert model_digest(str(tmp_path / "a" / "m.gguf")) != model_digest(str(tmp_path / "b" / "m.gguf"))


def test_not_local_falls_back_to_name_with_one_warning(tmp_path, monkeypatch, caplog):
    empty = str(tmp_path / "hf-cache")  # nothing cached there
    monkeypatch.setattr(model_identity, "_warned_names", set())
    with caplog.at_level(logging.WARNING, logger=model_identity.__name__):
        first = model_digest("some-org/some-model", download_dir=empty)
        assert model_digest("some-org/some-model", download_dir=empty) == first
        assert model_digest("some-org/some-model", revision="v2", download_dir=empty) != first
        assert model_digest("other-org/some-model", download_dir=empty) != first
    warned = [r.getMessage() for r in caplog.records if "rests on its name" in r.getMessage()]
    assert len(warned) == 2 and "some-org/some-model" in warned[0] and "other-org/some-model" in warned[1]


def test_hub_id_resolved_in_download_dir(tmp_path, monkeypatch):
    """A hub id that vLLM downloaded is hashed from the cached snapshot, like a local directory."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "downloads"
    repo = cache / "models--org--tiny"
    make_model(repo / "snapshots" / ("0" * 40), seed=3)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    local = make_model(tmp_path / "local" / "tiny", seed=3)
    monkeypatch.setattr(model_identity, "_warned_names", set())
    assert model_digest("org/tiny", download_dir=str(cache)) == model_digest(str(local))


# ---- store_namespace --------------------------------------------------------------------------

def fake_vllm_config(model_path, served_name=None, load_format="auto"):
    hf = SimpleNamespace(num_hidden_layers=2, vocab_size=128)
    mc = SimpleNamespace(model=str(model_path), served_model_name=served_name, revision=None, dtype="float32",
                         hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), hf_text_config=hf,
                         get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 16)
    cache = SimpleNamespace(cache_dtype="auto", block_size=16, prefix_caching_hash_algo="sha256")
    load = SimpleNamespace(load_format=load_format, download_dir=None)
    return SimpleNamespace(model_config=mc, cache_config=cache, load_config=load)


def test_store_namespace_by_content(tmp_path):
    a = make_model(tmp_path / "a" / "m", seed=1)
    b = make_model(tmp_path / "b" / "m", seed=2)
    copy = shutil.copytree(a, tmp_path / "mnt" / "models" / "m")
    ns_a = store_namespace(fake_vllm_config(a))
    assert ns_a.startswith(b"ucm-blend/v3|model:" + model_digest(str(a)).encode())
    assert store_namespace(fake_vllm_config(b)) != ns_a
    # Same model at another path and under another served name: same namespace, the KV is shared.
    assert store_namespace(fake_vllm_config(copy, served_name=["tenant-x"])) == ns_a
    # Dummy weights (vLLM's seeded random values) are not the files' weights.
    assert store_namespace(fake_vllm_config(a, load_format="dummy")) != ns_a


def test_store_namespace_follows_runtime_settings_that_change_kv(tmp_path):
    """A quantization method or config overrides given at run time change the KV without touching
    the files: another namespace. A plain engine's namespace does not carry them."""
    from transformers import LlamaConfig

    a = make_model(tmp_path / "a" / "m", seed=1)
    plain = store_namespace(fake_vllm_config(a))
    assert b"quant:" not in plain and b"overrides:" not in plain

    def with_settings(quantization=None, overrides=None, rope_theta=10000.0):
        config = fake_vllm_config(a)
        config.model_config.quantization = quantization
        config.model_config.hf_overrides = overrides or {}
        config.model_config.hf_text_config = LlamaConfig(num_hidden_layers=2, vocab_size=128, rope_theta=rope_theta)
        return store_namespace(config)

    assert with_settings() == plain
    assert b"|quant:fp8" in with_settings(quantization="fp8")
    scaled = with_settings(overrides={"rope_theta": 20000.0}, rope_theta=20000.0)
    assert b"|overrides:" in scaled and scaled != plain
    assert with_settings(overrides={"rope_theta": 40000.0}, rope_theta=40000.0) != scaled
    # A function override is identified by the config it produced.
    assert with_settings(overrides=lambda c: c, rope_theta=20000.0) == scaled
