"""Request helpers shared by the end-to-end tests."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams

from ucm.eval.datasets import generate_synthetic
from ucm.eval.prompts import build_prompt

if TYPE_CHECKING:
    from ucm.store.nfs_store import UcmNfsStore

# For tests that compute a prompt, then reuse or damage what it stored: every computed block is
# stored (admission first_sighting; the default's second sightings are tested with the scheduler).
STORE_ALL = {"admission": "first_sighting"}
LOGPROB_TOL = 1e-4
NUM_LAYERS, KV_HEADS, HEAD_SIZE = 30, 3, 64  # the embedded model's KV geometry
MARKER = 2  # <|im_end|>, the chunk end token of the prompts below


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    report: dict  # RequestOutput.kv_transfer_params["ucm"]: what the cache did for the request
    cached_tokens: int | None = None  # RequestOutput.num_cached_tokens (the API's usage.cached_tokens)


def params(max_tokens=8, ratio=None, disable=False, selection=None, exact_prefix=None, chunk_start_tokens=None,
           kv_shift=None, kv_shift_sample=None):
    kv = {}
    if kv_shift is not None:
        kv["ucm_kv_shift"] = kv_shift
    if kv_shift_sample is not None:
        kv["ucm_kv_shift_sample"] = kv_shift_sample
    if chunk_start_tokens is not None:
        kv["ucm_chunk_start_tokens"] = chunk_start_tokens
    if exact_prefix is not None:
        kv["ucm_exact_prefix"] = exact_prefix
    if ratio is not None:
        kv["ucm_blend_ratio"] = ratio
    if selection is not None:
        kv["ucm_blend_selection"] = selection
    if disable:
        kv["ucm_disable_blend"] = True
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0,
                          extra_args={"kv_transfer_params": kv} if kv else None)


def result(out) -> Result:
    comp = out.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)]
    return Result(list(comp.token_ids), lps, (out.kv_transfer_params or {}).get("ucm", {}), out.num_cached_tokens)


def run(llm, token_ids, cache_salt=None, lora_request=None, **kw) -> Result:
    prompt = {"prompt_token_ids": list(token_ids)}
    if cache_salt:
        prompt["cache_salt"] = cache_salt
    return result(llm.generate([prompt], params(**kw), use_tqdm=False, lora_request=lora_request)[0])


def forget_local_prefix_cache(llm) -> None:
    """Empty vLLM's own prefix cache (the store keeps everything): a prompt sent again is not
    served from the blocks of its earlier run."""
    assert llm.reset_prefix_cache()


def assert_same(a: Result, b: Result, tol=LOGPROB_TOL):
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        assert math.isclose(x, y, abs_tol=tol), (a.logprobs, b.logprobs)


def prompts(llm, seed, passages=4, words=200) -> tuple[list[int], list[int]]:
    """Token ids of a generated question's prompt, passages in order and reversed."""
    ex = generate_synthetic(num_examples=1, passages_per_example=passages, passage_words=words, seed=seed)[0]
    tok = llm.get_tokenizer()
    order = list(range(passages))
    first = build_prompt(tok, ex, MARKER, order=order)
    reordered = build_prompt(tok, ex, MARKER, order=order[::-1])
    return first.token_ids, reordered.token_ids


def read_blocks(store: UcmNfsStore, keys: list[bytes], sizes: list[int], timeout: float = 30.0) -> torch.Tensor:
    """The stored blocks, back to back: [tokens, layers, 2 (K, V), kv_heads, head_size] float32.

    The worker finishes dumps asynchronously, so wait until every key is visible.
    """
    deadline = time.monotonic() + timeout
    while not all(found := store.lookup(keys)):
        assert time.monotonic() < deadline, f"blocks not stored after {timeout} s: {found}"
        time.sleep(0.1)
    assert [m.token_count for m in store.read_meta(keys)] == sizes
    buffers = [torch.empty((NUM_LAYERS, n, 2, KV_HEADS, HEAD_SIZE), dtype=torch.float32) for n in sizes]  # stored form
    ok = store.wait(store.load(keys, [b.view(torch.uint8).numpy().reshape(-1) for b in buffers]))
    assert ok == [True] * len(keys)
    return torch.cat([b.transpose(0, 1) for b in buffers])


def block_files(store_dir) -> list:
    """The block files in a store directory."""
    return sorted(store_dir.rglob("*.kvb"))


def wait_until_stable(store_dir, seconds: float = 1.0, timeout: float = 30.0) -> int:
    """Dumps finish in the background: wait until the number of block files stops changing."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        n = len(block_files(store_dir))
        if n == last:
            return n
        last = n
        time.sleep(seconds)
    return last
