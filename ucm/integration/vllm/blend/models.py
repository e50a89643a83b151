"""Model classes that run Blend's forward when the connector has chunk KV loaded this step.

They subclass vLLM's own classes and change nothing else: without a Blend step (no chunk hit,
no connector, Blend not configured) they call the parent's forward, compiled graphs included.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from ucm.integration.vllm.blend.blend_forward import blend_forward
from ucm.integration.vllm.blend_step import BLEND_MODELS_BUILT


def current_blend_step():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    take = getattr(get_kv_transfer_group(), "take_blend_step", None)
    return take() if take is not None else None


def blend_forward_failed(exc: BaseException) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().blend_forward_failed(exc)


class BlendMixin:
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):  # vLLM reads this signature
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        BLEND_MODELS_BUILT.append(type(self).__name__)  # the connector checks for it at start-up

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        step = current_blend_step()
        if step is None or intermediate_tensors is not None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        try:
            with torch.inference_mode():
                return blend_forward(self.model, step, input_ids, positions, inputs_embeds)
        except Exception as exc:  # fail towards computing: vLLM's forward, its blend requests recomputed
            blend_forward_failed(exc)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


class BlendLlamaForCausalLM(BlendMixin, LlamaForCausalLM):
    pass


class BlendQwen2ForCausalLM(BlendMixin, Qwen2ForCausalLM):
    pass


class BlendQwen3ForCausalLM(BlendMixin, Qwen3ForCausalLM):
    pass

