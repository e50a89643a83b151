"""Model identity by content: a digest of what defines a model's weights, not of where they lie.

The store namespace (`ucm_connector.store_namespace`) must keep apart two models whose KV differ
even when their directories have the same name (two fine-tunes in `.../a/model` and
`.../b/model` once shared KV silently), and must match one model copied to two paths (machines of
one deployment mount models in different places). So the digest covers, and covers only:

- `config.json`, canonicalised: parsed and dumped with sorted keys, so whitespace and key order
  do not count; `_name_or_path` (a path) and `transformers_version` (the writer's version) are
  dropped;
- every weight file directly in the directory (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`,
  `*.gguf`), sorted by file name: its name, its size and a BLAKE2b of its first, middle and last
  MiB (of the whole file when it is at most 3 MiB).

Sampling keeps start-up cheap (at most 3 MiB read per file) and gives the same digest on every
machine. The price: a change to a large file that keeps its size and touches none of the three
sampled windows is not seen (fine-tunes rewrite every tensor, so their samples differ). Neither
the directory's path nor the served model name enters, nor do tokenizer files (store keys hash
token ids, not text).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 1 << 20  # each sampled window: head, middle, tail
DIGEST_BYTES = 16  # 32 hex characters
# config.json keys that say where or by what the file was written, not what the model is.
_CONFIG_IGNORED = ("_name_or_path", "transformers_version")

_warned_names: set[str] = set()


def _file_sample(path: str, size: int) -> bytes:
    """BLAKE2b of the file's first, middle and last SAMPLE_BYTES (the whole file if small)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for offset in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def _canonical_config(path: str, ignored: tuple[str, ...]) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        config = json.loads(raw)
    except ValueError:
        return raw  # not JSON: vLLM will refuse it anyway; its bytes are still an identity
    if isinstance(config, dict):
        for key in ignored:
            config.pop(key, None)
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def _update_file(h: hashlib.blake2b, path: str) -> None:
    name = os.path.basename(path).encode()
    size = os.path.getsize(path)
    h.update(b"file\0" + len(name).to_bytes(4, "little") + name + size.to_bytes(8, "little"))
    h.update(_file_sample(path, size))


def resolve_local(model: str, revision: str | None, download_dir: str | None) -> str | None:
    """A local directory or file for `model`: itself, or the Hugging Face cache snapshot that vLLM
    downloaded a hub id into (never downloads anything)."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception:  # not a hub id, not cached, or no huggingface_hub: the caller falls back
        return None


def model_digest(model_path: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Hex digest (32 characters) of the model's config.json and weight files (see the module doc).

    `model_path` is vLLM's `model_config.model`: a local directory (always, in this project), a
    single weight file (e.g. a GGUF), or a hub id resolved to the local Hugging Face cache
    (`download_dir` is vLLM's `load_config.download_dir`). Where nothing local is found, the
    digest is that of the name and revision, and a warning says so once per name.
    """
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ucm-model-id")
    local = resolve_local(str(model_path), revision, download_dir)
    if local is None:
        if model_path not in _warned_names:
            _warned_names.add(model_path)
            logger.warning("model %s (revision %s) is not a local directory or cached download: the KV store's "
                           "model identity rests on its name alone, so another model of that name would "
                           "share its stored KV", model_path, revision)
        h.update(b"name\0" + f"{model_path}@{revision or ''}".encode())
        return h.hexdigest()
    if os.path.isfile(local):
        _update_file(h, local)
        return h.hexdigest()
    hash_directory(h, local, "config.json", _CONFIG_IGNORED)
    return h.hexdigest()


def hash_directory(h: hashlib.blake2b, local: str, config_name: str, ignored: tuple[str, ...]) -> None:
    """Adds a directory's config file (canonicalised, without the `ignored` keys; skipped when
    absent) and its weight files, sorted by name, to `h` (the model's and a LoRA adapter's alike)."""
    names = sorted(os.listdir(local))
    if config_name in names:
        config = _canonical_config(os.path.join(local, config_name), ignored)
        h.update(b"config\0" + len(config).to_bytes(8, "little") + config)
    for name in names:
        path = os.path.join(local, name)
        if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            _update_file(h, path)


def runtime_identity(model_config) -> list[str]:
    """Settings of the running engine that change its KV without changing config.json or the
    weight files: the quantization method vLLM applies (`--quantization`, or one read from the
    config), and Hugging Face config overrides (`--hf-overrides`, dict or function: RoPE scaling,
    theta, ...), identified by a digest of the effective text config. Empty when neither is set,
    so a plain model's namespace does not change."""
    parts = []
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        parts.append(f"quant:{quantization}")
    if getattr(model_config, "hf_overrides", None):
        config = model_config.hf_text_config.to_dict()
        for key in _CONFIG_IGNORED:
            config.pop(key, None)
        raw = json.dumps(config, sort_keys=True, default=repr, separators=(",", ":")).encode()
        parts.append("overrides:" + hashlib.blake2b(raw, digest_size=DIGEST_BYTES).hexdigest())
    return parts
