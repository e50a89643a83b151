"""The contract between the connector's worker half and the Blend forward: what the loads of a
step hand the forward (once, then cleared), per request rather than per token.

The connector builds a `BlendStep` in `start_load_kv`; the Blend model class takes it at the start
of its forward (`take_blend_step`) and reports a failure back (`blend_forward_failed`). Neither
side needs the other's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ucm.integration.vllm.kv_layout import KVLayout
from ucm.sparse.blend.vocabulary import Selection

# Names of the Blend model classes instantiated in this process (ucm.integration.vllm.blend.models
# adds them): a Blend config without one would hand regions to a forward that never runs them.
BLEND_MODELS_BUILT: list[str] = []


def require_blend_models(architectures) -> None:
    """Refuses Blend at start-up when this process did not build the Blend model class.

    vLLM's own forward computes only the scheduled token of a blend request: its region
    (misses, question, recomputed share) would stay stale and be stored as if computed.
    """
    if BLEND_MODELS_BUILT:
        return
    raise ValueError(
        f"ucm_sparse_config.Blend is configured but the model ({architectures}) was not built with the Blend "
        "forward (ucm.integration.vllm.blend.models), so blended regions would never be computed. Cause: "
        "UCM_BLEND_NO_MODELS=1, or VLLM_PLUGINS excluding 'ucm', or a model_class_overrides entry. Fix: unset "
        "UCM_BLEND_NO_MODELS and let the 'ucm' plugin load, or remove ucm_sparse_config.Blend to use the "
        "store for prefix offload only.")


class Counters(Protocol):
    """The worker's counters as the forward sees them (the connector's UCMConnectorStats)."""

    def add(self, name: str, value: int | float = 1) -> None: ...


@dataclass
class RegionRows:
    """One blend request's region, as the forward runs it beside the request's scheduled rows."""

    first_slot: int  # slot of the request's first scheduled token: finds the request in the batch
    positions: torch.Tensor  # [m] prompt positions of the region
    token_ids: torch.Tensor  # [m]
    slots: torch.Tensor  # [m]
    ratio: float
    selection: Selection  # the rule ranking this request's loaded tokens
    question_end: int  # probe queries come from rows before this position
    chunk_starts: torch.Tensor  # [c] sorted prompt positions where its loaded chunks start
    chunk_start_tokens: int  # recomputed at the start of every loaded chunk before any ranking
    kv_shift: float  # share of its chunk's mean error the KV not recomputed is moved by (0: off)
    kv_shift_sample: float = 0.0  # share of each loaded chunk's tokens, evenly spaced, that estimate the shift


@dataclass
class BlendStep:
    """What the Blend forward of this step needs from the loads (handed over once, then cleared)."""

    loaded_slots: torch.Tensor  # [n] slots whose KV was loaded (every layer)
    check_v: torch.Tensor  # [n, kv_heads, head_size] loaded V of the check layer
    # [n, kv_heads, head_size] loaded K of the check layer, at the new positions; kept only when a
    # request of the step ranks by K deviation (key_l1 / key_l2), else None.
    check_k: torch.Tensor | None
    regions: list[RegionRows]  # one per blend request
    check_layer: int
    layout: KVLayout
    caches: list[torch.Tensor]  # every layer's paged KV cache (the check layer's holds fresh KV once it ran)
    stats: Counters  # the worker's counters: the forward adds recomputed / reused tokens
    rope: tuple | None = None  # (float32 cos/sin cache, is_neox_style) of the model: the KV shift rotates K errors
    max_rows: int | None = None  # the scheduler's cap on the rows run beside vLLM's (checked, counted if passed)
    # (layer, ratio) of each later check layer: the selection narrows there (gradual filtering)
    narrowing: tuple[tuple[int, float], ...] = ()
    # Layer-wise loading: places the loaded KV of every layer up to the one given, waiting for its
    # reads (raises when they failed); None: every layer was placed before the forward.
    layers_ready: Callable[[int], None] | None = None

    def wait_layers(self, layer: int) -> None:
        """Before the loaded KV of layers up to `layer` is read (attention, a gather)."""
        if self.layers_ready is not None:
            self.layers_ready(layer)
