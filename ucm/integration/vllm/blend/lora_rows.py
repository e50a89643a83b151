"""vLLM's LoRA mapping for the rows the Blend forward runs.

vLLM's LoRA layers find each token's adapter in a mapping the model runner sets before the
forward (the punica wrapper's indices over its scheduled rows). The Blend forward runs other
rows: each blend request's region rows inserted before its own, and subsets of the batch in
each pass. For every such pass this points the wrapper at one index per row of the pass (the
adapter of the request that owns the row), in the per-token form that takes rows in any order,
and puts vLLM's mapping back afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class LoraRows:
    punica: object  # vLLM's PunicaWrapperCPU, shared by every LoRA layer of the model
    token: torch.Tensor  # [rows] adapter slot of each batch row's request (-1: none)
    embedding: torch.Tensor  # [rows] each row's offset into the embedding's LoRA table

    @classmethod
    def of(cls, model, owner: torch.Tensor) -> LoraRows | None:
        """The mapping of a batch whose row i belongs to the request of vLLM's scheduled row
        ``owner[i]``; None when the engine runs without LoRA."""
        punica = punica_wrapper(model)
        if punica is None:
            return None
        if type(punica).__name__ != "PunicaWrapperCPU":
            raise NotImplementedError(f"Blend with LoRA supports vLLM's CPU punica wrapper; this engine uses "
                                      f"{type(punica).__name__}")
        return cls(punica, punica.token_lora_indices[owner].clone(),
                   punica._embeddings_indices[owner].clone())

    @contextlib.contextmanager
    def rows(self, index: torch.Tensor):
        """vLLM's LoRA layers see the batch rows `index` (int64) as the whole batch inside."""
        p = self.punica
        saved = p._token_lora_indices, p._embeddings_indices, list(p.indices_len), p.is_prefill
        p._token_lora_indices, p._embeddings_indices = self.token[index], self.embedding[index]
        p.indices_len[0] = p.indices_len[3] = int(index.shape[0])
        p.is_prefill = False  # the per-token kernels: no grouping of rows by adapter assumed
        try:
            yield
        finally:
            p._token_lora_indices, p._embeddings_indices, p.indices_len[:], p.is_prefill = saved


def punica_wrapper(model):
    """The punica wrapper vLLM's LoRA layers of `model` share, or None (found once, then cached)."""
    cached = model.__dict__.get("_ucm_punica", False)
    if cached is False:
        cached = next((m.punica_wrapper for m in model.modules() if getattr(m, "punica_wrapper", None) is not None),
                      None)
        model.__dict__["_ucm_punica"] = cached
    return cached


def within(lora: LoraRows | None, index: torch.Tensor):
    """`lora.rows(index)`, or nothing to do without LoRA."""
    return contextlib.nullcontext() if lora is None else lora.rows(index)
