"""LoraRows against vLLM's real CPU punica wrapper: a pass over any subset of the batch's rows, in
any order, gets the same LoRA output per row as vLLM's whole-batch mapping gives it."""

import torch
from torch import nn
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from ucm.integration.vllm.blend.lora_rows import LoraRows, punica_wrapper

RANK, IN, OUT = 4, 16, 12


def mapped_wrapper(index_mapping, prompt_mapping, lora_ids=(1, 2)):
    p = PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    p.update_metadata(LoRAMapping(index_mapping, prompt_mapping, is_prefill=True), list(lora_ids), len(lora_ids),
                      vocab_size=100)
    return p


def lora_out(p, x, a, b):
    y = torch.zeros(x.shape[0], OUT)
    p.add_lora_linear(y, x, (a,), (b,), 1.0, (OUT,))
    return y


class _Holder(nn.Module):
    def __init__(self, punica):
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.inner.punica_wrapper = punica


def test_subset_rows_get_their_requests_adapters():
    gen = torch.Generator().manual_seed(0)
    # vLLM's batch: request 0 (adapter 1) 3 rows, request 1 (adapter 2) 2 rows.
    p = mapped_wrapper((1, 1, 1, 2, 2), (1, 2))
    a, b = torch.randn(2, 1, RANK, IN, generator=gen), torch.randn(2, 1, OUT, RANK, generator=gen)
    # The Blend batch: 4 region rows of request 0 before its own, 3 of request 1 before its own.
    owner = torch.tensor([0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3])
    model = _Holder(p)
    lora = LoraRows.of(model, owner)
    x = torch.randn(owner.shape[0], IN, generator=gen)
    per_row = torch.stack([x[i] @ a[k, 0].T @ b[k, 0].T for i, k in enumerate([0] * 7 + [1] * 5)])
    before = p.token_lora_indices.clone()
    for index in (torch.arange(12), torch.tensor([9, 2, 11, 0]), torch.tensor([5])):
        with lora.rows(index):
            assert p.token_lora_indices.tolist() == [0 if i < 7 else 1 for i in index.tolist()]
            y = lora_out(p, x[index], a, b)
        torch.testing.assert_close(y, per_row[index], rtol=1e-5, atol=1e-5)
    assert p.is_prefill and torch.equal(p.token_lora_indices, before)  # vLLM's mapping is back


def test_engine_without_lora_has_no_mapping():
    assert LoraRows.of(nn.Sequential(nn.Linear(2, 2)), torch.arange(3)) is None


def test_wrapper_is_found_once():
    p = mapped_wrapper((1,), (1,))
    model = _Holder(p)
    assert punica_wrapper(model) is p
    model.inner.punica_wrapper = None
    assert punica_wrapper(model) is p  # cached: the LoRA layers keep one wrapper for the engine's life
