"""Engines and stores for an evaluation run: arguments, the Blend engine, a store directory per run."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ucm.config import CHUNK_STORE_POLICIES, KV_SHIFT_DEFAULT, QUERY_SELECTION, attn_layer_name
from ucm.sparse.blend.vocabulary import is_ratio
from ucm.store.config import GB
from ucm.eval.modes import DEFAULT_CHECK_LAYER, DEFAULT_RATIO, parse_selections
from ucm.eval.summary import started_at_commit


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser raising ValueError, as an argparse type (whose error message argparse shows)."""
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
    p.add_argument("--skip-questions", type=int, default=0, metavar="N",
                   help="start at question N of the data set (for generated sets: the questions a run of N + "
                        "num-questions would end with, so later questions are held out from earlier runs)")
    p.add_argument("--passages", type=int, default=passages,
                   help="passages per generated question")
    p.add_argument("--passage-words", type=int, default=passage_words,
                   help="words per generated passage")
    p.add_argument("--min-question-tokens", type=int, default=0, metavar="N",
                   help="only questions whose message (template included) is over N tokens, the first "
                        "--num-questions of them (e.g. 32: longer than the query rule's probe)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length in tokens")
    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help="Blend recompute ratio of the 'blend' mode")
    p.add_argument("--selections", type=_arg_type(parse_selections), default=list(selections),
                   help="how the Blend modes rank the tokens they recompute, comma-separated: 'query' (attention "
                        "the question pays each token, the default rule), 'hkvd' (V deviation alone, "
                        "CacheBlend's rule), 'key_l1' / 'key_l2' (K deviation: UCM's / LMCache's rules), "
                        "'chunk_start' (EPIC: the first tokens of every chunk) and/or 'oracle' (a diagnostic "
                        "ranking from a full prefill run first, a reference for the others; its TTFT is not "
                        "Blend's)")
    p.add_argument("--kv-shift", type=float, default=None, metavar="SHARE",
                   help="share in [0, 1] of its chunk's mean KV error the reused KV of the Blend modes is moved by "
                        "(compute_meta kv_shift; default: the config's, " + f"{KV_SHIFT_DEFAULT:g})")
    p.add_argument("--check-layer", type=int, default=DEFAULT_CHECK_LAYER, metavar="N",
                   help="the layer whose KV deviation (and the question's attention there) ranks the tokens "
                        "recomputed (compute_meta's key)")
    p.add_argument("--later-checks", type=_later_checks, default=(), metavar="LAYER:RATIO[,LAYER:RATIO]",
                   help="check layers after the first (CacheBlend's gradual filtering): at each the selection "
                        "narrows to that ratio of the loaded tokens (a request's own ratio caps it), e.g. 4:0.15")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="vLLM's step budget (max_num_batched_tokens); Blend runs up to 4x as many rows beside it per step")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model and KV dtype (default: float32 on CPU, the model's own elsewhere); on CPUs with AMX, "
                        "bfloat16 prefill is about 3x faster than float32")
    p.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=None,
                   help="use_layerwise: a Blend step's chunk KV read layer group by layer group while its forward "
                        "runs (the default); --no-layerwise reads whole blocks before the forward")
    p.add_argument("--chunk-store", choices=CHUNK_STORE_POLICIES, default="any",
                   help="which missed chunks the store keeps: 'any' (as first computed, after whatever text came "
                        "before), 'alone' (only chunks computed with nothing before them; the passages are then "
                        "indexed alone)")
    p.add_argument("--store-capacity-gb", type=float, default=None,
                   help="cap on the store's size in GiB, least recently used blocks evicted first (default: half "
                        "the free disk space at start for a temporary store, else no cap); a long run on ~6k-token "
                        "prompts writes about 0.5 GiB per question")


def _later_checks(text: str) -> tuple[tuple[int, float], ...]:
    try:
        pairs = tuple((int(layer), float(ratio)) for layer, ratio in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:RATIO[,LAYER:RATIO], e.g. 4:0.15; got {text!r}") from None
    return pairs


def check_run_args(p, args) -> None:
    if not 0.0 <= args.ratio <= 1.0:
        p.error("--ratio must be in [0, 1]")
    if args.kv_shift is not None and not is_ratio(args.kv_shift):
        p.error(f"--kv-shift must be a share in [0, 1], got {args.kv_shift:g}")
    if args.num_questions < 1:
        p.error("--num-questions must be at least 1")
    if args.check_layer < 0:
        p.error("--check-layer must be >= 0")
    if args.store_capacity_gb is not None and not args.store_capacity_gb > 0:
        p.error("--store-capacity-gb must be positive")


def kv_shift_note(args) -> str:
    """What the engine's Blend modes do with the reused KV, for a run's header."""
    share = args.kv_shift if args.kv_shift is not None else KV_SHIFT_DEFAULT
    return f"kv_shift {share:g}" if share else "no kv_shift"


def examples_and_model(args) -> tuple[list, str]:
    """The data set and model directory of a command-line run (the embedded model unless --model).

    A bad data set ends the program with its error and exit status 2, before anything slow starts.
    """
    from ucm.eval.datasets import DatasetError, load_dataset

    from ucm.models import model_path

    longer = getattr(args, "min_question_tokens", 0)
    try:
        examples = load_dataset(args.dataset, limit=None if longer else args.num_questions,
                                skip=getattr(args, "skip_questions", 0), passages_per_example=args.passages,
                                passage_words=args.passage_words)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    model = model_path(args.model)
    if longer:
        from transformers import AutoTokenizer

        from ucm.eval.prompts import question_tokens

        tokenizer = AutoTokenizer.from_pretrained(model)
        examples = [e for e in examples if question_tokens(tokenizer, e) > longer][:args.num_questions]
    return examples, model


def make_blend_llm(model: str, store_dir: str, ratio: float = DEFAULT_RATIO, max_num_batched_tokens: int = 8192,
                   capacity_gb: float | None = None, chunk_store: str | None = None, kv_shift: float | None = None,
                   blend_options: dict[str, Any] | None = None, check_layer: int = DEFAULT_CHECK_LAYER,
                   later_checks: tuple[tuple[int, float], ...] = (), layerwise: bool | None = None, **overrides: Any):
    """One engine for every mode: the ratio is overridden per request.

    max_num_batched_tokens above the prompts keeps full prefill (the baseline) in one step; Blend
    fits any budget (docs/serving.md). TTFT comes from vLLM's request metrics, which need stats
    logging on.
    """
    from transformers import AutoTokenizer

    from ucm.eval.prompts import chunk_end_token_id
    from ucm.integration.vllm.llm import make_llm, ucm_transfer_config

    kwargs: dict[str, Any] = {"max_num_batched_tokens": max_num_batched_tokens, "disable_log_stats": False}
    kwargs.update(overrides)
    marker = chunk_end_token_id(AutoTokenizer.from_pretrained(model))  # the model's own <|im_end|>
    return make_llm(model, kv_transfer_config=ucm_transfer_config(store_dir, ratio, chunk_end_token_id=marker,
                                                                  capacity_gb=capacity_gb, chunk_store=chunk_store,
                                                                  kv_shift=kv_shift, blend_options=blend_options,
                                                                  check_layer=attn_layer_name(check_layer),
                                                                  later_checks=later_checks, layerwise=layerwise),
                    **kwargs)


@dataclass
class RunStore:
    path: str
    temporary: bool
    capacity_gb: float | None


def bfloat16_note(dtype: str | None) -> str | None:
    """A hint when a float32 CPU run leaves a faster dense baseline unmeasured: with AMX or
    AVX512-BF16, bfloat16 prefill is faster than float32 (docs/research.md, "Pick the dtype")."""
    import torch

    from ucm.integration.vllm.llm import is_cpu_platform

    if dtype not in (None, "float32") or not is_cpu_platform():
        return None
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return None
    return ("note:  this CPU computes bfloat16 natively (AMX or AVX512-BF16): dense bfloat16 prefill may be "
            "faster than this float32 baseline; compare with --dtype bfloat16")


def run_on_engine(args, store: RunStore, fn: Callable[[Any], Any], **engine: Any):
    """fn(llm) on a Blend engine for a command-line run (`engine`: more engine arguments),
    stopped afterwards whatever happens."""
    from ucm.integration.vllm.llm import shutdown

    note = bfloat16_note(args.dtype)
    if note:
        print(note, flush=True)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    started_at_commit()  # recorded now: the code this run runs, whatever is committed before it ends
    # Passages left unindexed must stay missed: not computed alone and stored while the engine idles.
    blend_options = {"background_chunks": False} if getattr(args, "miss_passages", 0) else None
    llm = make_blend_llm(args.model, store.path, ratio=args.ratio, max_num_batched_tokens=args.max_num_batched_tokens,
                         capacity_gb=store.capacity_gb, chunk_store=args.chunk_store, kv_shift=args.kv_shift,
                         blend_options=blend_options, check_layer=getattr(args, "check_layer", DEFAULT_CHECK_LAYER),
                         later_checks=getattr(args, "later_checks", ()), layerwise=getattr(args, "layerwise", None),
                         **dtype,
                         **engine)
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
