"""Measuring the modes on questions: indexing, one timed request per mode, what the cache did."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucm.eval.datasets import QAExample
from ucm.eval.metrics import best_f1, normalize_answer, short_answer, token_f1
from ucm.eval.prompts import RELATED, ChunkedPrompt, build_prompt, chunk_end_token_id
from ucm.eval.modes import Mode, REPORT_KEY


@dataclass
class Measurement:
    question: int  # index in the data set
    mode: str
    ratio: float | None
    prompt_tokens: int
    ttft_s: float
    ttft_source: str  # "metrics" (vLLM's first_token_latency) or "wall" (generate() wall time)
    text: str
    answer: str  # short_answer(text): what F1 scores
    f1_gold: float
    f1_vs_full: float | None = None  # None for full prefill itself
    agrees_with_full: bool | None = None
    report: dict = field(default_factory=dict)  # kv_transfer_params["ucm"]
    counters: dict = field(default_factory=dict)  # the connector's statistics counters during the request
    # Next-token KL(full prefill || this mode), teacher-forced over full prefill's first answer
    # tokens (mean over them); None for full prefill itself or when not measured.
    kl_vs_full: float | None = None

    @property
    def blended(self) -> bool:
        return bool(self.report.get("blended"))


@dataclass
class QuestionResult:
    question: int
    prompt_tokens: int
    index_s: float  # wall time of the indexing step (all passages, batched)
    index_reports: list[dict]
    measurements: list[Measurement]


def indexing_prompts(prompt: ChunkedPrompt, alone: bool = False) -> list[list[int]]:
    """``[system][passage i]`` (or ``[passage i]`` alone) for every passage of a built prompt,
    ending with the chunk marker.

    The chunk tokens are cut from the prompt itself, so they are the tokens the prompt's chunk
    hashes are computed from. Under the "alone" chunk-store policy only chunks with nothing before
    them are stored, so the passages are indexed alone.
    """
    bounds, start = [], 0
    for n in prompt.chunk_lengths:
        bounds.append((start, start + n))
        start += n
    system = [] if alone else prompt.token_ids[bounds[0][0]:bounds[0][1]]
    return [system + prompt.token_ids[a:b] for a, b in bounds[1:]]


def missed_passages(num_passages: int, k: int) -> list[int]:
    """`k` passage indices spread evenly over `num_passages` (the middle of k equal parts)."""
    if not 0 <= k <= num_passages:
        raise ValueError(f"cannot leave {k} of {num_passages} passages unindexed")
    return [int((j + 0.5) * num_passages / k) for j in range(k)]


class BlendEvaluator:
    """Runs the modes of each question on one Blend-enabled engine, one request at a time."""

    def __init__(self, llm, max_tokens: int = 16, max_num_batched_tokens: int | None = None,
                 index_alone: bool = False, kl_tokens: int = 0, related: dict[str, list[str]] | None = None,
                 miss_passages: int = 0, before_ask: Callable[[], None] | None = None):
        self.llm = llm
        # Called before every timed request, after the engine's prefix cache is emptied: a store on a
        # real disk evicts its pages there, so the request reads from the disk as a cold one would.
        self.before_ask = before_ask
        # Passages per question left out of the indexing step, spread over the prompt: cache
        # misses between loaded chunks, as on a RAG stream (the engine must not store them when
        # computed in context: chunk_store "alone").
        self.miss_passages = miss_passages
        # Answer tokens over which the next-token KL to full prefill is measured (0: not measured;
        # the engine needs max_logprobs=-1): one extra one-token request per token and mode.
        self.kl_tokens = kl_tokens
        self.index_alone = index_alone  # index passages alone (the "alone" chunk-store policy)
        self.related = related or {}  # passage -> passages indexed before it as context (related.py)
        self.max_tokens = max_tokens
        self.tokenizer = llm.get_tokenizer()
        self.marker = chunk_end_token_id(self.tokenizer)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.wall_fallbacks = 0

    def params(self, max_tokens: int, chunk_lengths: Sequence[int], ratio: float | None = None,
               disable_blend: bool = False, selection: str | None = None, chunk_start_tokens: int | None = None,
               logprobs: int | None = None, kv_shift: float | None = None, kv_shift_sample: float | None = None):
        from vllm import SamplingParams

        kv: dict[str, Any] = {"ucm_chunk_lengths": list(chunk_lengths), "ucm_exact_prefix": False}
        if disable_blend:
            kv["ucm_disable_blend"] = True
        if ratio is not None:
            kv["ucm_blend_ratio"] = ratio
        if selection is not None:
            kv["ucm_blend_selection"] = selection
        if chunk_start_tokens is not None:
            kv["ucm_chunk_start_tokens"] = chunk_start_tokens
        if kv_shift is not None:
            kv["ucm_kv_shift"] = kv_shift
        if kv_shift_sample is not None:
            kv["ucm_kv_shift_sample"] = kv_shift_sample
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                              extra_args={"kv_transfer_params": kv})

    def mode_params(self, max_tokens: int, chunked: ChunkedPrompt, mode: Mode, logprobs: int | None = None):
        return self.params(max_tokens, chunked.chunk_lengths, ratio=mode.ratio, disable_blend=mode.is_full,
                           selection=mode.selection, chunk_start_tokens=mode.chunk_start_tokens, logprobs=logprobs,
                           kv_shift=mode.kv_shift, kv_shift_sample=mode.kv_shift_sample)

    def next_token_logprobs(self, chunked: ChunkedPrompt, mode: Mode, answer_ids: Sequence[int]) -> list:
        """The mode's next-token log-probabilities (``[vocab]`` float32 tensors) after the prompt
        and each prefix ``answer_ids[:j]``, j < kl_tokens: teacher forcing on a given answer.

        Each prefix is its own request (a Blend request returns its last row only); the answer
        tokens extend the question, so every mode computes them in full over its own chunk KV.
        """
        import torch

        out = []
        for j in range(min(self.kl_tokens, len(answer_ids))):
            self.forget_local_prefix_cache()
            prompt = {"prompt_token_ids": chunked.token_ids + list(answer_ids[:j])}
            res = self.llm.generate([prompt], self.mode_params(1, chunked, mode, logprobs=-1), use_tqdm=False)[0]
            top = res.outputs[0].logprobs[0]
            ids = torch.tensor(list(top.keys()), dtype=torch.long)
            values = torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float32)
            dense = torch.full((int(ids.max()) + 1,), float("-inf"))
            dense[ids] = values
            out.append(dense)
        return out

    def build(self, example: QAExample) -> ChunkedPrompt:
        return build_prompt(self.tokenizer, example, self.marker)

    def index(self, prompt: ChunkedPrompt, passages: Sequence[str] = ()) -> tuple[float, list[dict]]:
        """Store every chunk of the prompt (batched; these requests blend only the system chunk).
        With `related`, each passage is indexed after its related passages (one context chunk,
        worded so that it is never stored under a passage's own hash)."""
        system = 0 if self.index_alone else prompt.chunk_lengths[0]
        token_ids = indexing_prompts(prompt, self.index_alone)
        contexts = [self.context_ids(self.related.get(p, ())) for p in passages] or [[] for _ in token_ids]
        # At most half of them: the warm-up question has 2 passages (the command line checks the rest).
        missed = set(missed_passages(len(token_ids), min(self.miss_passages, len(token_ids) // 2)))
        token_ids = [ids for i, ids in enumerate(token_ids) if i not in missed]
        contexts = [ctx for i, ctx in enumerate(contexts) if i not in missed]
        prompts = [{"prompt_token_ids": ids[:system] + ctx + ids[system:]} for ids, ctx in zip(token_ids, contexts)]
        params = [self.params(1, [n for n in (system, len(ctx), len(ids) - system) if n])
                  for ids, ctx in zip(token_ids, contexts)]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [report_of(o) for o in outs]

    def context_ids(self, texts: Sequence[str]) -> list[int]:
        return [t for text in texts for t in self.tokenizer.encode(RELATED.format(passage=text), add_special_tokens=False)]

    def forget_local_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache (requests still running?)")

    def counters(self) -> dict[str, float]:
        """The connector's cumulative statistics counters (empty when vLLM's stats logging is off)."""
        from ucm.integration.vllm.connector.stats import ucm_counters

        try:
            return ucm_counters()
        except AssertionError:  # LLMEngine.get_metrics asserts that stats logging is on
            return {}

    def ask(self, chunked: ChunkedPrompt, mode: Mode) -> tuple[str, float, str, dict, dict, list[int]]:
        """(answer text, TTFT in s, TTFT source, connector report, counter deltas, answer token ids)
        of one request alone."""
        prompt = {"prompt_token_ids": chunked.token_ids}
        self.forget_local_prefix_cache()
        if self.before_ask is not None:
            self.before_ask()
        params = self.mode_params(self.max_tokens, chunked, mode)
        before = self.counters()
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        after = self.counters()
        deltas = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        ttft = getattr(getattr(out, "metrics", None), "first_token_latency", None)
        ids = list(out.outputs[0].token_ids)
        if ttft:
            return out.outputs[0].text, float(ttft), "metrics", report_of(out), deltas, ids
        # No request metrics (stats logging off): time a one-token request instead, as cold as
        # the first one.
        self.wall_fallbacks += 1
        self.forget_local_prefix_cache()
        if self.before_ask is not None:
            self.before_ask()
        one = self.mode_params(1, chunked, mode)
        start = time.perf_counter()
        self.llm.generate([prompt], one, use_tqdm=False)
        return out.outputs[0].text, time.perf_counter() - start, "wall", report_of(out), deltas, ids

    def run_question(self, qi: int, example: QAExample, modes: Sequence[Mode],
                     on_measurement: Callable[[Measurement], None] | None = None) -> QuestionResult:
        prompt = self.build(example)
        index_s, index_reports = self.index(prompt, example.passages if self.related else ())
        measurements: list[Measurement] = []
        full: Measurement | None = None
        reference: list = []  # full prefill's next-token distributions over its own answer
        full_ids: list[int] = []
        for mode in modes:
            text, ttft, source, report, counters, ids = self.ask(prompt, mode)
            answer = short_answer(text)
            m = Measurement(qi, mode.name, mode.ratio, len(prompt.token_ids), ttft, source, text, answer,
                            best_f1(answer, list(example.answers)), report=report, counters=counters)
            if mode.is_full:
                full, full_ids = m, ids
                if self.kl_tokens:
                    reference = self.next_token_logprobs(prompt, mode, full_ids)
            elif full is not None:
                m.f1_vs_full = token_f1(answer, full.answer)
                m.agrees_with_full = normalize_answer(answer) == normalize_answer(full.answer)
                if reference:
                    m.kl_vs_full = mean_kl(reference, self.next_token_logprobs(prompt, mode, full_ids))
            measurements.append(m)
            if on_measurement is not None:
                on_measurement(m)
        return QuestionResult(qi, len(prompt.token_ids), index_s, index_reports, measurements)

    def warm_up(self, example: QAExample, modes: Sequence[Mode]) -> None:
        """One small question through every code path (first calls pay for lazy set-up)."""
        self.run_question(-1, example, modes)

    def check_fits(self, examples: Sequence[QAExample]) -> tuple[list[tuple[int, QAExample]], list[str]]:
        """(index, example) of the questions that fit the engine, and a warning for each problem.

        Prompts longer than max_num_batched_tokens are kept with a warning (full prefill, the
        baseline, then takes several steps); prompts that leave no room for the answer in
        max_model_len would fail the engine (left out).
        """
        kept, warnings = [], []
        max_model_len = getattr(getattr(self.llm.llm_engine, "model_config", None), "max_model_len", None)
        for i, ex in enumerate(examples):
            n = len(self.build(ex).token_ids)
            if isinstance(max_model_len, int) and n + self.max_tokens > max_model_len:
                warnings.append(f"question {i}: prompt of {n} tokens + {self.max_tokens} answer tokens exceeds "
                                f"max_model_len={max_model_len}; left out")
                continue
            if self.max_num_batched_tokens is not None and n > self.max_num_batched_tokens:
                warnings.append(f"question {i}: prompt of {n} tokens exceeds max_num_batched_tokens="
                                f"{self.max_num_batched_tokens}; its full prefill (the baseline) is split "
                                "over several steps")
            kept.append((i, ex))
        return kept, warnings


def mean_kl(reference: Sequence, other: Sequence) -> float:
    """Mean over positions of KL(reference || other), each a ``[vocab]`` log-probability tensor
    (tokens missing from one side count as probability 0 there)."""
    import torch

    kls = []
    for p, q in zip(reference, other):
        n = max(p.shape[0], q.shape[0])
        p = torch.nn.functional.pad(p.double(), (0, n - p.shape[0]), value=float("-inf"))
        q = torch.nn.functional.pad(q.double(), (0, n - q.shape[0]), value=float("-inf"))
        seen = p > float("-inf")  # 0 * log(0 / q) is 0
        kls.append(float((p[seen].exp() * (p[seen] - q[seen])).sum()))
    return sum(kls) / len(kls)


def run_questions(evaluator: BlendEvaluator, examples: Sequence[QAExample], modes: Sequence[Mode], *,
                  warm_up: bool = True, desc: str = "answering", unit: str = "answer",
                  on_measurement: Callable[[Measurement], None] | None = None,
                  on_question: Callable[[QuestionResult, QAExample], None] | None = None,
                  ) -> tuple[list[QuestionResult], dict[str, float]]:
    """Every question that fits the engine, under a progress bar; (results, run-wide counters).

    Callbacks that print should use tqdm.write, which keeps the bar intact.
    """
    from tqdm import tqdm

    from ucm.eval.datasets import generate_synthetic

    questions, warnings = evaluator.check_fits(examples)
    for line in warnings:
        print(f"WARNING: {line}", flush=True)
    if warm_up:
        print("warming up the engine on a small generated question ...", flush=True)
        evaluator.warm_up(generate_synthetic(num_examples=1, passages_per_example=2, passage_words=60,
                                             seed=12345)[0], modes)
    results = []
    with tqdm(total=len(questions) * len(modes), unit=unit, desc=desc, dynamic_ncols=True) as bar:
        def progress(m: Measurement) -> None:
            bar.set_postfix_str(f"{m.mode}: TTFT {m.ttft_s:.2f}s")
            bar.update()
            if on_measurement is not None:
                on_measurement(m)

        for qi, ex in questions:
            bar.set_description(f"question {qi + 1}/{len(examples)}")
            result = evaluator.run_question(qi, ex, modes, on_measurement=progress)
            results.append(result)
            if on_question is not None:
                on_question(result, ex)
    return results, evaluator.counters()


def report_of(out) -> dict:
    return dict((getattr(out, "kv_transfer_params", None) or {}).get(REPORT_KEY) or {})
