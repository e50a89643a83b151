"""A tiny LoRA adapter directory in PEFT's file layout, for tests of adapter identity (no model
loads it: only its files matter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"],
          "base_model_name_or_path": "/models/base"}


def write_weights(path: Path, seed: int) -> None:
    """(Re)writes adapter_model.safetensors: same names and shapes whatever the seed."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(2, 8, generator=gen),
               f"{prefix}.lora_B.weight": torch.randn(8, 2, generator=gen)}, str(path / "adapter_model.safetensors"))


def write_adapter(path: Path, seed: int = 0, config: dict = CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    write_weights(path, seed)
    return path


def retrain_in_place(path: Path, seed: int) -> None:
    """New weights in the same file (same name, same size). A real retraining takes longer than
    the file system's timestamp granularity; here the mtime is moved on so that it surely differs."""
    weights = path / "adapter_model.safetensors"
    before = weights.stat()
    write_weights(path, seed)
    after = weights.stat()
    assert after.st_size == before.st_size
    os.utime(weights, ns=(after.st_atime_ns, max(after.st_mtime_ns, before.st_mtime_ns + 1_000_000)))
