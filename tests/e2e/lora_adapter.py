"""A small random LoRA adapter for the embedded model, written in PEFT's file format.

No adapter for SmolLM2 ships in a pip package and nothing may be downloaded, so the tests make
one: random A and B on every attention and MLP projection, large enough that the adapter changes
the model's answers (checked by the tests that use it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_dir: Path, out_dir: Path, rank: int = 8, scale: float = 0.05,
                         seed: int = 0) -> Path:
    """Writes adapter_config.json and adapter_model.safetensors into `out_dir`; returns it."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    shapes = {"q_proj": (hidden, cfg["num_attention_heads"] * head), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (cfg["num_attention_heads"] * head, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return out_dir
