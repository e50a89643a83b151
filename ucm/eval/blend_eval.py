"""Full prefill against Blend on one engine: TTFT, answer quality and cache counters.

Shared by the main job (examples/offline_inference_blend.py) and the benchmark
(benchmarks/blend_bench.py). Per question:

1. Indexing: every passage is prefilled once on its own, as ``[system][passage]`` (what a RAG
   system's indexing step would do), which stores the KV of each chunk. These requests are
   batched and not timed as answers.
2. Each mode answers the whole prompt (system, passages in the data set's order, question), one
   request at a time, back to back:
   * full prefill: ``ucm_disable_blend`` (no chunk reuse);
   * Blend at ratio r: the chunks' stored KV is loaded and r of the loaded tokens are recomputed
     after the check layer (r = 0: full reuse, r = 1: recompute all of them).
   Before every measured request vLLM's local prefix cache is emptied, and the request leaves
   the store's exact prefix unused (``ucm_exact_prefix: false``): a mode is never helped by an
   earlier mode of the same question, and Blend reuses chunk KV only. All requests run under no
   ``cache_salt`` (one tenant): chunk KV is shared exactly where a prefix could be.

Every request states its chunks (system message and passages) in ``ucm_chunk_lengths``, so the
question is the prompt's suffix, recomputed by every mode as a user's new question would be.
Split at the marker instead, the question message (which ends with <|im_end|> as well) would be a
chunk of its own: the first Blend mode of a question would store it and every later mode would
reuse its KV, so the modes would not be measured alike.

Nothing here imports vLLM at module level; engines are built by the callers' main processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ucm.config import BLEND_SELECTIONS, CHUNK_STORE_POLICIES, QUERY_SELECTION
from ucm.sparse.blend.vocabulary import Selection, check_ratio
from ucm.eval.datasets import QAExample
from ucm.eval.metrics import best_f1, bootstrap_ci, normalize_answer, short_answer, token_f1
from ucm.eval.prompts import ChunkedPrompt, build_prompt, chunk_end_token_id
from ucm.store.config import GB

DEFAULT_CHECK_LAYER = "model.layers.1.self_attn.attn"
DEFAULT_RATIO = 0.15
SWEEP_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
REPORT_KEY = "ucm"  # RequestOutput.kv_transfer_params[REPORT_KEY]: what the cache did


# ---- modes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str
    ratio: float | None  # None: full prefill (Blend disabled for the request)
    selection: str | None = None  # how Blend ranks the tokens it recomputes; None: ratio 0 or 1 (no ranking)

    @property
    def is_full(self) -> bool:
        return self.ratio is None


FULL_PREFILL = Mode("full prefill", None)


def blend_mode(ratio: float, selection: str = QUERY_SELECTION) -> Mode:
    """"blend R" ranks by the question's attention per cost x deviation (the default), "hkvd R" by deviation alone
    (CacheBlend's rule), "oracle R" by a full prefill (diagnostic); ratio 0 ("full reuse") and 1 ("blend 1") rank
    nothing, so they are one mode."""
    check_ratio(ratio, "Blend ratio")
    if Selection.parse(selection) is None:
        raise ValueError(f"selection must be one of {', '.join(BLEND_SELECTIONS)}, got {selection!r}")
    if ratio == 0:
        return Mode("full reuse", 0.0)
    if ratio == 1:
        return Mode("blend 1", 1.0)
    prefix = "blend" if selection == QUERY_SELECTION else selection
    return Mode(f"{prefix} {ratio:g}", float(ratio), selection)


def modes_for(ratios: Iterable[float], selections: Iterable[str] = (QUERY_SELECTION,)) -> list[Mode]:
    """Full prefill (the reference every other mode is compared with) first, then each ratio
    for each selection rule."""
    modes = [FULL_PREFILL]
    for selection in selections:
        for r in ratios:
            m = blend_mode(r, selection)
            if m not in modes:
                modes.append(m)
    return modes


def parse_selections(text: str) -> list[str]:
    """'query,hkvd' -> ['query', 'hkvd'] (argparse type; any of BLEND_SELECTIONS)."""
    selections = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in selections if x not in BLEND_SELECTIONS]
    if bad or not selections:
        raise ValueError(f"selections must be a comma-separated list of {', '.join(BLEND_SELECTIONS)}, got {text!r}")
    return selections


def parse_ratios(text: str) -> list[float]:
    """'0,0.15,1' -> [0.0, 0.15, 1.0] (argparse type)."""
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"ratios must be comma-separated numbers, got {text!r}") from exc
    for r in ratios:
        blend_mode(r)
    if not ratios:
        raise ValueError("no ratio given")
    return ratios


# ---- engine --------------------------------------------------------------------------------------


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser raising ValueError, as an argparse type (whose error message argparse shows)."""
    import argparse

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return convert


def add_run_args(p, *, num_questions: int, passages: int, passage_words: int,
                 selections: Sequence[str] = (QUERY_SELECTION,)) -> None:
    """Options the main job and the benchmark share (their defaults differ)."""
    p.add_argument("--num-questions", type=int, default=num_questions)
    p.add_argument("--passages", type=int, default=passages,
                   help=f"passages per generated question (default {passages})")
    p.add_argument("--passage-words", type=int, default=passage_words,
                   help=f"words per generated passage (default {passage_words})")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length in tokens (default 16)")
    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help=f"Blend recompute ratio of the 'blend' mode (default {DEFAULT_RATIO})")
    p.add_argument("--selections", type=_arg_type(parse_selections), default=list(selections),
                   help="how the Blend modes rank the tokens they recompute, comma-separated: 'query' (attention "
                        "of the question per cost x deviation, the default rule), 'hkvd' (deviation alone, "
                        "CacheBlend's rule) and/or 'oracle' (a diagnostic ranking from a full prefill run "
                        f"first, a reference for the others; its TTFT is not Blend's) (default {','.join(selections)})")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="scheduler step budget; a prompt blends only when it fits in one step (default 8192)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model and KV dtype (default: float32 on CPU, the model's own elsewhere); on CPUs with AMX, "
                        "bfloat16 prefill is about 3x faster than float32")
    p.add_argument("--chunk-store", choices=CHUNK_STORE_POLICIES, default="any",
                   help="which missed chunks the store keeps: 'any' (as first computed, after whatever text came "
                        "before), 'alone' (only chunks computed with nothing before them; the passages are then "
                        "indexed alone) (default any)")
    p.add_argument("--store-capacity-gb", type=float, default=None,
                   help="cap on the store's size in GiB, least recently used blocks evicted first (default: half "
                        "the free disk space at start for a temporary store, else no cap); a long run on ~6k-token "
                        "prompts writes about 0.5 GiB per question")


def check_run_args(p, args) -> None:
    if not 0.0 <= args.ratio <= 1.0:
        p.error("--ratio must be in [0, 1]")
    if args.num_questions < 1:
        p.error("--num-questions must be at least 1")
    if args.store_capacity_gb is not None and not args.store_capacity_gb > 0:
        p.error("--store-capacity-gb must be positive")


def examples_and_model(args) -> tuple[list, str]:
    """The data set and model directory of a command-line run (the embedded model unless --model).

    A bad data set ends the program with its error and exit status 2, before anything slow starts.
    """
    from ucm.eval.datasets import DatasetError, load_dataset

    try:
        examples = load_dataset(args.dataset, limit=args.num_questions, num_examples=args.num_questions,
                                passages_per_example=args.passages, passage_words=args.passage_words)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if args.model:
        return examples, args.model
    from ucm.models import prepare

    return examples, str(prepare())


def make_blend_llm(model: str, store_dir: str, ratio: float = DEFAULT_RATIO, max_num_batched_tokens: int = 8192,
                   capacity_gb: float | None = None, chunk_store: str | None = None, **overrides: Any):
    """One engine for every mode: the ratio is overridden per request.

    max_num_batched_tokens above the prompts keeps full prefill (the baseline) in one step; Blend
    fits any budget (docs/serving.md). TTFT comes from vLLM's request metrics, which need stats
    logging on.
    """
    from ucm.integration.vllm.llm import make_llm, ucm_transfer_config

    kwargs: dict[str, Any] = {"max_num_batched_tokens": max_num_batched_tokens, "disable_log_stats": False}
    kwargs.update(overrides)
    return make_llm(model, kv_transfer_config=ucm_transfer_config(store_dir, ratio, capacity_gb=capacity_gb,
                                                                  chunk_store=chunk_store), **kwargs)


@dataclass
class RunStore:
    path: str
    temporary: bool
    capacity_gb: float | None


def bfloat16_note(dtype: str | None) -> str | None:
    """A hint when a float32 CPU run leaves a faster dense baseline unmeasured: with AMX or
    AVX512-BF16, bfloat16 prefill measured 1.4x (AVX512-BF16) to 3x (AMX) faster than float32."""
    import torch

    from ucm.integration.vllm.llm import is_cpu_platform

    if dtype not in (None, "float32") or not is_cpu_platform():
        return None
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return None
    return ("note:  this CPU computes bfloat16 natively (AMX or AVX512-BF16): dense bfloat16 prefill may be "
            "faster than this float32 baseline; compare with --dtype bfloat16")


def run_on_engine(args, store: RunStore, fn: Callable[[Any], Any]):
    """fn(llm) on a Blend engine for a command-line run, stopped afterwards whatever happens."""
    from ucm.integration.vllm.llm import shutdown

    note = bfloat16_note(args.dtype)
    if note:
        print(note, flush=True)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    llm = make_blend_llm(args.model, store.path, ratio=args.ratio, max_num_batched_tokens=args.max_num_batched_tokens,
                         capacity_gb=store.capacity_gb, chunk_store=args.chunk_store, **dtype)
    try:
        return fn(llm)
    finally:
        shutdown(llm)


@contextlib.contextmanager
def run_store(args, prefix: str, keep: bool = False):
    """The store of a command-line run: --store-dir, else a temporary directory removed at the end.

    SIGTERM (`timeout`, `kill`) ends the run through the same clean-up, so a stopped run does not
    leave gigabytes of KV behind (SIGKILL still does).
    """
    temporary = args.store_dir is None
    path = args.store_dir or tempfile.mkdtemp(prefix=prefix)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        yield RunStore(path, temporary, store_capacity_gb(args, path, temporary))
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if temporary and not keep:
            shutil.rmtree(path, ignore_errors=True)
            print(f"removed the temporary store {path}", flush=True)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def store_capacity_gb(args, store_dir: str, temporary: bool) -> float | None:
    """The store cap of a command-line run: --store-capacity-gb, else half the free space for a temporary store.

    Every question writes its chunks and its full-prefill blocks (about 0.5 GiB at 6k tokens on the
    embedded model); without a cap a long run fills the disk, after which nothing more is stored
    and every later question falls back to full computation (with a warning per request).
    """
    if args.store_capacity_gb is not None or not temporary:
        return args.store_capacity_gb
    return shutil.disk_usage(store_dir).free / 2 / GB


# ---- measuring -----------------------------------------------------------------------------------


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


class BlendEvaluator:
    """Runs the modes of each question on one Blend-enabled engine, one request at a time."""

    def __init__(self, llm, max_tokens: int = 16, max_num_batched_tokens: int | None = None,
                 index_alone: bool = False):
        self.llm = llm
        self.index_alone = index_alone  # index passages alone (the "alone" chunk-store policy)
        self.max_tokens = max_tokens
        self.tokenizer = llm.get_tokenizer()
        self.marker = chunk_end_token_id(self.tokenizer)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.wall_fallbacks = 0

    def params(self, max_tokens: int, chunk_lengths: Sequence[int], ratio: float | None = None,
               disable_blend: bool = False, selection: str | None = None):
        from vllm import SamplingParams

        kv: dict[str, Any] = {"ucm_chunk_lengths": list(chunk_lengths), "ucm_exact_prefix": False}
        if disable_blend:
            kv["ucm_disable_blend"] = True
        if ratio is not None:
            kv["ucm_blend_ratio"] = ratio
        if selection is not None:
            kv["ucm_blend_selection"] = selection
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": kv})

    def build(self, example: QAExample) -> ChunkedPrompt:
        return build_prompt(self.tokenizer, example, self.marker)

    def index(self, prompt: ChunkedPrompt) -> tuple[float, list[dict]]:
        """Store every chunk of the prompt (batched; these requests blend only the system chunk)."""
        system = 0 if self.index_alone else prompt.chunk_lengths[0]
        prompts = [{"prompt_token_ids": ids} for ids in indexing_prompts(prompt, self.index_alone)]
        params = [self.params(1, [n for n in (system, len(p["prompt_token_ids"]) - system) if n])
                  for p in prompts]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [report_of(o) for o in outs]

    def forget_local_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache (requests still running?)")

    def counters(self) -> dict[str, float]:
        """The connector's cumulative statistics counters (empty when vLLM's stats logging is off)."""
        from ucm.integration.vllm.connector.stats import ucm_counters

        try:
            return ucm_counters(self.llm.get_metrics())
        except AssertionError:  # LLMEngine.get_metrics asserts that stats logging is on
            return {}

    def ask(self, chunked: ChunkedPrompt, mode: Mode) -> tuple[str, float, str, dict, dict]:
        """(answer text, TTFT in s, TTFT source, connector report, counter deltas) of one request alone."""
        prompt = {"prompt_token_ids": chunked.token_ids}
        self.forget_local_prefix_cache()
        params = self.params(self.max_tokens, chunked.chunk_lengths, ratio=mode.ratio, disable_blend=mode.is_full,
                             selection=mode.selection)
        before = self.counters()
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        after = self.counters()
        deltas = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        ttft = getattr(getattr(out, "metrics", None), "first_token_latency", None)
        if ttft:
            return out.outputs[0].text, float(ttft), "metrics", report_of(out), deltas
        # No request metrics (stats logging off): time a one-token request instead, as cold as
        # the first one.
        self.wall_fallbacks += 1
        self.forget_local_prefix_cache()
        one = self.params(1, chunked.chunk_lengths, ratio=mode.ratio, disable_blend=mode.is_full,
                          selection=mode.selection)
        start = time.perf_counter()
        self.llm.generate([prompt], one, use_tqdm=False)
        return out.outputs[0].text, time.perf_counter() - start, "wall", report_of(out), deltas

    def run_question(self, qi: int, example: QAExample, modes: Sequence[Mode],
                     on_measurement: Callable[[Measurement], None] | None = None) -> QuestionResult:
        prompt = self.build(example)
        index_s, index_reports = self.index(prompt)
        measurements: list[Measurement] = []
        full: Measurement | None = None
        for mode in modes:
            text, ttft, source, report, counters = self.ask(prompt, mode)
            answer = short_answer(text)
            m = Measurement(qi, mode.name, mode.ratio, len(prompt.token_ids), ttft, source, text, answer,
                            best_f1(answer, list(example.answers)), report=report, counters=counters)
            if mode.is_full:
                full = m
            elif full is not None:
                m.f1_vs_full = token_f1(answer, full.answer)
                m.agrees_with_full = normalize_answer(answer) == normalize_answer(full.answer)
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


# ---- summary -------------------------------------------------------------------------------------


@dataclass
class ModeSummary:
    mode: str
    ratio: float | None
    selection: str | None
    n: int
    mean_ttft_s: float
    median_ttft_s: float
    speedup: float | None  # median full-prefill TTFT / this mode's median TTFT
    f1_gold: float
    f1_vs_full: float | None
    agree_pct: float | None
    blended: int  # requests the connector reports as blended
    chunk_hit_tokens: int
    chunk_hit_blocks: int
    chunk_blocks: int
    external_prefix_tokens: int
    dumped_blocks: int
    # Totals of the connector's statistics counters over the mode's requests (see stats.COUNTERS);
    # zero when vLLM's stats logging is off.
    recomputed_tokens: int = 0
    reused_tokens: int = 0
    load_bytes: int = 0
    load_ms: float = 0.0
    # Paired with full prefill question by question: this mode's F1 gold minus full prefill's.
    f1_gold_delta: float | None = None
    # 95% bootstrap intervals over the questions (None for full prefill itself or one question).
    f1_gold_delta_ci: tuple[float, float] | None = None
    f1_vs_full_ci: tuple[float, float] | None = None
    agree_pct_ci: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def recomputed_pct(self) -> float | None:
        loaded = self.recomputed_tokens + self.reused_tokens
        return 100.0 * self.recomputed_tokens / loaded if loaded else None


def summarize(measurements: Sequence[Measurement], modes: Sequence[Mode]) -> list[ModeSummary]:
    by_mode = {m.name: [x for x in measurements if x.mode == m.name] for m in modes}
    full_rows = by_mode.get(FULL_PREFILL.name) or []
    full_median = statistics.median(x.ttft_s for x in full_rows) if full_rows else None
    full_gold = {x.question: x.f1_gold for x in full_rows}
    out = []
    for mode in modes:
        rows = by_mode[mode.name]
        if not rows:
            continue
        ttfts = [x.ttft_s for x in rows]
        median = statistics.median(ttfts)
        vs_full = [x.f1_vs_full for x in rows if x.f1_vs_full is not None]
        agree = [x.agrees_with_full for x in rows if x.agrees_with_full is not None]
        deltas = [] if mode.is_full else [x.f1_gold - full_gold[x.question] for x in rows if x.question in full_gold]

        def total(key: str) -> int:
            return sum(int(x.report.get(key) or 0) for x in rows)

        def counted(key: str) -> float:
            return sum(x.counters.get(key, 0) for x in rows)

        out.append(ModeSummary(
            mode=mode.name, ratio=mode.ratio, selection=mode.selection, n=len(rows),
            mean_ttft_s=statistics.mean(ttfts), median_ttft_s=median,
            speedup=(full_median / median) if full_median and median > 0 else None,
            f1_gold=statistics.mean(x.f1_gold for x in rows),
            f1_vs_full=statistics.mean(vs_full) if vs_full else None,
            agree_pct=100.0 * sum(agree) / len(agree) if agree else None,
            blended=sum(x.blended for x in rows),
            chunk_hit_tokens=total("chunk_hit_tokens"), chunk_hit_blocks=total("chunk_hit_blocks"),
            chunk_blocks=total("chunk_blocks"), external_prefix_tokens=total("external_prefix_tokens"),
            dumped_blocks=total("dumped_blocks"),
            recomputed_tokens=int(counted("recomputed_tokens")), reused_tokens=int(counted("reused_tokens")),
            load_bytes=int(counted("load_bytes")), load_ms=float(counted("load_ms")),
            f1_gold_delta=statistics.mean(deltas) if deltas else None, f1_gold_delta_ci=bootstrap_ci(deltas),
            f1_vs_full_ci=bootstrap_ci(vs_full), agree_pct_ci=bootstrap_ci([100.0 * a for a in agree]),
        ))
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(summaries: Sequence[ModeSummary]) -> str:
    """Speed and quality, one row per mode."""
    header = ["mode", "ratio", "n", "mean TTFT", "median TTFT", "speed-up", "F1 gold", "F1 vs full", "agree"]
    rows = [[
        s.mode, _fmt(s.ratio, "g"), str(s.n), _fmt(s.mean_ttft_s, ".3f", "s"), _fmt(s.median_ttft_s, ".3f", "s"),
        _fmt(s.speedup, ".2f", "x"), _fmt(s.f1_gold, ".3f"), _fmt(s.f1_vs_full, ".3f"), _fmt(s.agree_pct, ".0f", "%"),
    ] for s in summaries]
    return _aligned(header, rows)


def format_interval_table(summaries: Sequence[ModeSummary]) -> str:
    """Quality against full prefill with 95% bootstrap intervals over the questions, one row per Blend mode."""
    def with_ci(value: float | None, ci: tuple[float, float] | None, spec: str, suffix: str = "") -> str:
        if value is None:
            return "-"
        text = f"{value:{spec}}{suffix}"
        return text if ci is None else f"{text} ({ci[0]:{spec}} .. {ci[1]:{spec}}{suffix})"

    header = ["mode", "n", "F1 gold - full prefill", "F1 vs full", "agree"]
    rows = [[
        s.mode, str(s.n), with_ci(s.f1_gold_delta, s.f1_gold_delta_ci, "+.3f"),
        with_ci(s.f1_vs_full, s.f1_vs_full_ci, ".3f"), with_ci(s.agree_pct, s.agree_pct_ci, ".0f", "%"),
    ] for s in summaries if s.ratio is not None]
    return _aligned(header, rows)


def format_tables(summaries: Sequence[ModeSummary]) -> str:
    """The report of a run: speed and quality, quality with its intervals, what the cache did."""
    return "\n\n".join([format_table(summaries), format_interval_table(summaries), format_cache_table(summaries)])


def format_cache_table(summaries: Sequence[ModeSummary]) -> str:
    """What the cache did, one row per mode: the per-request reports and the statistics counters."""
    header = ["mode", "blended", "chunk hit blocks", "chunk hit tok", "recomputed tok", "loaded MB", "load ms/req",
              "dumped blocks"]
    rows = [[
        s.mode, f"{s.blended}/{s.n}", f"{s.chunk_hit_blocks}/{s.chunk_blocks}", str(s.chunk_hit_tokens),
        f"{s.recomputed_tokens} ({s.recomputed_pct:.1f}%)" if s.recomputed_pct is not None else "-",
        f"{s.load_bytes / 1e6:.1f}", f"{s.load_ms / s.n:.0f}" if s.load_ms else "-", str(s.dumped_blocks),
    ] for s in summaries]
    return _aligned(header, rows)


def format_counters(counters: dict[str, float]) -> str:
    """The connector's statistics counters of a whole run (indexing and warm-up included), one line each."""
    from ucm.integration.vllm.connector.stats import COUNTERS

    width = max(map(len, COUNTERS))
    lines = []
    for name, meaning in COUNTERS.items():
        value = counters.get(name, 0)
        lines.append(f"  {name:<{width}}  {value:>14,.0f}  {meaning}")
    return "\n".join(lines)


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    rows = [header] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


TABLE_NOTES = (
    "TTFT: vLLM's first_token_latency, one request at a time; speed-up = median full-prefill TTFT / median TTFT.\n"
    "F1 gold: answer F1 against the data set's answers; F1 vs full / agree: the mode's answer against the\n"
    "full-prefill answer of the same question (token F1 / same normalised short answer).\n"
    "Modes: 'blend R' recomputes the share R of the loaded tokens ranked by the question's attention per\n"
    "cost x deviation (selection 'query'), 'hkvd R' by deviation alone (CacheBlend's rule), 'oracle R' by a\n"
    "full prefill run first (a reference for quality; its TTFT includes that prefill); full reuse = 0.\n"
    "Second table: F1 gold minus full prefill's, question by question, and the quality columns with their\n"
    "95% bootstrap intervals over the questions (one question more or less moves small samples a lot).\n"
    "Cache table: blended, chunk hit blocks / tokens, dumped blocks: totals of the connector's per-request\n"
    "reports (kv_transfer_params['ucm']); recomputed tok (share of the loaded chunk tokens), loaded MB, load\n"
    "ms/req: the connector's statistics counters (vLLM's KV connector stats, vllm:ucm_*) during the requests."
)


def write_results_json(path: str | Path, args, results: Sequence[QuestionResult], summaries: Sequence[ModeSummary],
                       modes: Sequence[Mode], started: float, counters: dict) -> None:
    """A run as JSON: its configuration, the summary of each mode and every answer of every question."""
    tokens = [r.prompt_tokens for r in results]
    data = {
        "config": {
            "model": args.model, "dataset": args.dataset or "generated", "num_questions": len(results),
            "passages": args.passages if args.dataset is None else None,
            "passage_words": args.passage_words if args.dataset is None else None,
            "max_tokens": args.max_tokens, "ratios": sorted({m.ratio for m in modes if m.ratio is not None}),
            "selections": args.selections, "dtype": args.dtype or "default",
            "max_num_batched_tokens": args.max_num_batched_tokens, "chunk_store": args.chunk_store,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "duration_s": round(time.time() - started, 1),
        },
        "prompt_tokens": {"min": min(tokens), "max": max(tokens), "mean": statistics.mean(tokens)},
        "summary": [s.to_dict() for s in summaries],
        "counters": counters,
        "questions": [{"question": r.question, "prompt_tokens": r.prompt_tokens, "index_s": r.index_s,
                       "measurements": [asdict(m) for m in r.measurements]} for r in results],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def unexpected_reports(measurements: Sequence[Measurement]) -> list[str]:
    """Blend requests that the connector did not blend, or that found no chunk in the store."""
    problems = []
    for m in measurements:
        if m.ratio is None:
            if m.blended:
                problems.append(f"question {m.question} {m.mode}: reported blended although Blend was disabled")
            continue
        if not m.report:
            problems.append(f"question {m.question} {m.mode}: no connector report")
        elif not m.blended:
            problems.append(f"question {m.question} {m.mode}: not blended (report {m.report})")
        elif m.report.get("chunk_hit_blocks", 0) < m.report.get("chunk_blocks", 0):
            problems.append(f"question {m.question} {m.mode}: only {m.report.get('chunk_hit_blocks')} of "
                            f"{m.report.get('chunk_blocks')} chunk blocks found in the store")
    return problems
