"""Blend against full prefill on ~6,000-token multi-document prompts: TTFT and answer quality.

One engine (UCM connector, Blend) serves every mode; per question the passages are first
prefilled one by one (the indexing step that stores each chunk), then the whole prompt is
answered by full prefill and by Blend at each ratio, one request at a time, back to back, with
vLLM's prefix cache emptied and the store's exact prefix unused before each, so no earlier request
serves them (see ucm/eval/__init__.py).

    python benchmarks/blend_bench.py                           # full prefill, Blend at --ratio (0.3), full reuse
    python benchmarks/blend_bench.py --sweep                   # ratios 0 .. 1 -> JSON (+ PNG)
    python benchmarks/blend_bench.py --num-questions 1 --sweep --ratios 0,0.15,1   # quick check
    python benchmarks/blend_bench.py --pareto                  # every rule, KL too -> JSON + PNG frontier

Data: ../shared/data/musique_dev.json (CacheBlend's MuSiQue set: 10 passages of ~600 tokens per
question) when it exists, else generated questions of 10 passages x ~450 words. On 2 CPU cores:
about 40 s of start-up and warm-up, then about 45 s per question for the default modes (full
prefill alone takes 18-25 s at 6,000 tokens) and about 90 s per question for the default sweep.
vLLM logs at WARNING level unless VLLM_LOGGING_LEVEL says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _mount_schedule import MountSchedule, mounted_store
from throttled_disk import ThrottledDisk  # tests/, on the path through _mount_schedule
from ucm.eval.quiet import quiet_vllm

quiet_vllm()  # before vLLM is imported: keep the progress bar readable (VLLM_LOGGING_LEVEL=INFO for vLLM's logs)

from ucm.eval.modes import (SWEEP_RATIOS, blend_mode, Mode, modes_for, pareto_modes, parse_ratios,  # noqa: E402
                            plus_chunk_start, plus_kv_shift, plus_shift_sample)
from ucm.argparse_help import HelpFormatter  # noqa: E402
from ucm.eval.engine import (add_run_args, check_run_args, examples_and_model, kv_shift_note, run_on_engine,  # noqa: E402
                             run_store)
from ucm.eval.measure import BlendEvaluator, run_questions  # noqa: E402
from ucm.eval.related import related_passages  # noqa: E402
from ucm.sparse.blend.vocabulary import is_ratio  # noqa: E402
from ucm.eval.summary import (TABLE_NOTES, format_counters, format_tables, ModeSummary, summarize, unexpected_reports,  # noqa: E402
                              write_results_json)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"
# Scratch paths: results to keep are written with --out benchmarks/results/...
DEFAULT_OUT = Path(tempfile.gettempdir()) / "blend_bench.json"
DEFAULT_PARETO_OUT = Path(tempfile.gettempdir()) / "blend_pareto.json"
PARETO_RATIOS = (0.05, 0.15, 0.3, 0.5)
PARETO_RULES = ("query", "hkvd", "key_l1", "key_l2")  # ours, CacheBlend's, UCM's, LMCache's
PARETO_CHUNK_START = (8, 16, 32)  # EPIC's k


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"),
                   help="model directory or a name of python -m ucm.models list (env MODEL_PATH; default: the "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=None,
                   help=f"CacheBlend JSON or LongBench JSONL (none: {DEFAULT_DATASET} if it exists, else generated)")
    p.add_argument("--generated", action="store_true", help="use the generated data set even if MuSiQue exists")
    add_run_args(p, num_questions=5, passages=10, passage_words=450, selections=("query", "hkvd"))
    p.add_argument("--sweep", action="store_true", help="measure every ratio of --ratios and write JSON (+ PNG)")
    p.add_argument("--ratios", type=_ratios, default=list(SWEEP_RATIOS),
                   help="comma-separated ratios of --sweep")
    p.add_argument("--pareto", action="store_true",
                   help="every rule (" + ", ".join(PARETO_RULES) + ") at --ratios (default "
                        + ",".join(f"{r:g}" for r in PARETO_RATIOS) + "), EPIC's chunk_start at --chunk-start "
                        "(default " + ",".join(map(str, PARETO_CHUNK_START)) + "), full reuse and ratio 1, with "
                        "the next-token KL; JSON + a PNG of quality against median TTFT")
    p.add_argument("--chunk-start", type=lambda t: [int(x) for x in t.split(",") if x.strip()],
                   default=list(PARETO_CHUNK_START), help="EPIC's k values for --pareto")
    p.add_argument("--plus-chunk-start", type=int, default=None, metavar="K",
                   help="also run every ranked mode with the first K tokens of each loaded chunk recomputed "
                        "first, within its ratio (EPIC's rows plus the rule)")
    p.add_argument("--plus-kv-shift", type=float, nargs="?", const=1.0, default=None, metavar="SHARE",
                   help="also run every ranked mode with the chunk-mean KV shift at SHARE of the mean (default 1; "
                        "0: none, whatever the engine's default; ucm_kv_shift)")
    p.add_argument("--plus-shift-sample", default=None, metavar="SAMPLE[,SHARE]",
                   help="also run every ranked mode with the KV shift (at SHARE, default 1) estimated from every "
                        "(1/SAMPLE)-th token of each loaded chunk, recomputed within its ratio (ucm_kv_shift_sample)")
    p.add_argument("--only-added", action="store_true",
                   help="with --plus-chunk-start / --plus-kv-shift / --plus-shift-sample: full prefill and the "
                        "added modes only")
    p.add_argument("--index-related", type=int, default=0, metavar="K",
                   help="index each passage after the K passages of the run most similar to it (TF-IDF), as "
                        "FusionRAG prepares chunk KV; default 0: after the system message alone")
    p.add_argument("--miss-passages", type=int, default=0, metavar="K",
                   help="leave K passages of each question (at most half) unindexed, spread over the prompt: cache misses "
                        "between loaded chunks, as on a RAG stream; needs --chunk-store alone, so that no mode "
                        "stores them in context for the next")
    p.add_argument("--kl-tokens", type=int, default=None,
                   help="measure the next-token KL to full prefill over this many answer tokens (one extra "
                        "request per token and mode; default 4 with --pareto, else 0)")
    p.add_argument("--out", default=None,
                   help=f"JSON result file (default with --sweep: {DEFAULT_OUT}; with --pareto: {DEFAULT_PARETO_OUT}); "
                        "the PNG goes next to it")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--store-dir", default=os.environ.get("DATA_DIR"),
                   help="KV store directory (env DATA_DIR; default: a temporary directory, removed at the end)")
    p.add_argument("--mount", default=None, metavar="SPEC",
                   help="the store behind a FUSE mount that adds steady faults (benchmarks/_mount_schedule.py): "
                        "'bandwidth_mb_s=200' (reads and writes capped, as on a loaded NFS link), 'latency_ms=5'; "
                        "';' joins them; needs FUSE (root)")
    p.add_argument("--disk", type=float, default=None, metavar="MB_S",
                   help="the store on a loop-mounted ext4 disk whose reads the kernel caps at MB_S (tests/throttled_disk.py: "
                        "no server process shares the cores, unlike --mount); its pages are evicted before every timed "
                        "request, so each reads from the disk; needs root")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up question")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's eager mode (runs before 2026-11-29 used it): full prefill then runs the layers as "
                        "Blend does, so ratio 1 equals it exactly; default: vLLM's compiled forward, as users get")
    p.add_argument("-v", "--verbose", action="store_true", help="print every answer")
    args = p.parse_args(argv)
    check_run_args(p, args)
    if args.pareto:
        if "--ratios" not in " ".join(argv if argv is not None else sys.argv):
            args.ratios = list(PARETO_RATIOS)
        if "--selections" not in " ".join(argv if argv is not None else sys.argv):
            args.selections = list(PARETO_RULES)
    if args.disk is not None:
        if args.store_dir or args.mount is not None:
            p.error("--disk makes a store of its own: drop --store-dir and --mount")
        if args.disk <= 0:
            p.error(f"--disk takes a positive read bandwidth in MB/s, got {args.disk}")
    if args.mount is not None:
        if args.store_dir:
            p.error("--mount makes a temporary store of its own: drop --store-dir")
        try:
            if MountSchedule.parse(args.mount).window:
                p.error("--mount takes steady faults only (latency_ms=, bandwidth_mb_s=): a window needs a stream")
        except ValueError as exc:
            p.error(str(exc))
    if args.miss_passages and (args.chunk_store != "alone" or args.miss_passages > args.passages // 2):
        p.error("--miss-passages needs --chunk-store alone and at most half of --passages")
    if args.kl_tokens is None:
        args.kl_tokens = 4 if args.pareto else 0
    if args.kl_tokens < 0:
        p.error("--kl-tokens must be >= 0")
    if args.plus_kv_shift is not None and not is_ratio(args.plus_kv_shift):
        p.error(f"--plus-kv-shift must be a share in [0, 1], got {args.plus_kv_shift:g}")
    if args.plus_shift_sample is not None:
        try:
            args.plus_shift_sample = [float(x) for x in args.plus_shift_sample.split(",")]
            plus_shift_sample([], *args.plus_shift_sample)
        except (TypeError, ValueError) as exc:
            p.error(f"--plus-shift-sample must be SAMPLE in (0, 0.5][,SHARE in [0, 1]]: {exc}")
    if args.dataset is None and not args.generated and DEFAULT_DATASET.is_file():
        args.dataset = str(DEFAULT_DATASET)
    if args.out is None and (args.sweep or args.pareto):
        args.out = str(DEFAULT_PARETO_OUT if args.pareto else DEFAULT_OUT)
    return args


def _ratios(text: str) -> list[float]:
    try:
        return parse_ratios(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    examples, args.model = examples_and_model(args)
    if args.pareto:
        modes = pareto_modes(args.ratios, args.selections, args.chunk_start)
    else:
        modes = modes_for(args.ratios if args.sweep else [args.ratio, 0.0], args.selections)
    added = (plus_chunk_start(modes, args.plus_chunk_start) if args.plus_chunk_start else []) + (
        plus_kv_shift(modes, args.plus_kv_shift) if args.plus_kv_shift is not None else []) + (
        plus_shift_sample(modes, *args.plus_shift_sample) if args.plus_shift_sample else [])
    modes = [m for m in modes if m.is_full] + added if args.only_added else modes + added
    with contextlib.ExitStack() as stack:
        disk = None
        if args.mount is not None:  # the run's store is the mount's (removed with it at the end)
            args.store_dir, mount = stack.enter_context(mounted_store(args.mount))
            mount.set(**MountSchedule.parse(args.mount).steady)
            args.store_medium = {"fuse_mount": args.mount}
        elif args.disk is not None:  # entered before the engine starts: its processes inherit the cap
            disk = stack.enter_context(ThrottledDisk(size_gb=DISK_GB, read_mb_s=args.disk))
            args.store_dir = str(disk.path / "store")
            args.store_capacity_gb = args.store_capacity_gb or DISK_GB * 0.8
            args.store_medium = {"throttled_disk_read_mb_s": args.disk}
        return _measure(args, examples, modes, stack.enter_context(run_store(args, "ucm-blend-bench-")), disk)


DISK_GB = 32  # --disk's image (sparse: only what the store writes takes space)


class ColdReads:
    """Called before each timed request: the disk's page cache emptied, so the request reads from
    the disk as a cold one would; counts what each request (with its KL requests) read."""

    def __init__(self, disk: ThrottledDisk):
        self.disk = disk
        self.per_request: list[int] = []  # warm-up question first
        self._since: int | None = None

    def __call__(self) -> None:
        self._close()
        self.disk.evict()
        self._since = self.disk.read_bytes()

    def _close(self) -> None:
        if self._since is not None:
            self.per_request.append(self.disk.read_bytes() - self._since)

    def finish(self) -> dict:
        self._close()
        self._since = None
        return {"read_bytes": self.disk.read_bytes(), "read_bytes_per_request": self.per_request}


def _measure(args, examples, modes: list[Mode], store, disk: ThrottledDisk | None = None) -> int:
    print(f"model:   {args.model}\nstore:   {store.path}{' (temporary)' if store.temporary else ''}\n"
          f"data:    {args.dataset or 'generated'} ({len(examples)} questions)\n"
          f"modes:   {', '.join(m.name for m in modes)} ({kv_shift_note(args)} unless named)", flush=True)
    started = time.time()
    engine = {"max_logprobs": -1} if args.kl_tokens else {}  # KL needs the whole next-token distribution
    if args.enforce_eager:
        engine["enforce_eager"] = True

    def partial(results) -> None:  # the JSON so far, after every question: a crash keeps what was measured
        if args.out:
            write_results_json(args.out, args, results, summarize([m for r in results for m in r.measurements],
                                                                  modes), modes, started, {"partial": True})

    cold = ColdReads(disk) if disk is not None else None
    results, counters = run_on_engine(args, store, lambda llm: run(llm, examples, modes, args, partial, cold), **engine)
    if cold is not None:
        args.store_medium.update(cold.finish())
        print(f"read from the throttled disk: {args.store_medium['read_bytes'] / 1e6:.0f} MB", flush=True)
    if not results:
        print("error: no question fits the engine (see the warnings above)", file=sys.stderr)
        return 1
    measurements = [m for r in results for m in r.measurements]
    summaries = summarize(measurements, modes)

    print_report(results, summaries, modes, args, counters)
    for line in unexpected_reports(measurements):
        print(f"WARNING: {line}")
    if args.out:
        out = Path(args.out)
        write_results_json(out, args, results, summaries, modes, started, counters)
        print(f"\nwrote {out}")
        if not args.no_plot:
            png = out.with_suffix(".png")
            message = write_frontier(png, summaries) if args.pareto else write_plot(png, summaries)
            print(message or f"wrote {png}")
    return 0


def run(llm, examples, modes: list[Mode], args, on_results=None, before_ask=None):
    from tqdm import tqdm

    done = []

    def show_answer(m):
        if args.verbose:
            tqdm.write(f"q{m.question + 1} {m.mode:<12} {m.prompt_tokens} tok  TTFT {m.ttft_s:7.3f}s  -> {m.answer!r}")

    def show_question(result, ex):
        if args.verbose:
            tqdm.write(f"    Q: {ex.question}  gold: {list(ex.answers)}")
        done.append(result)
        if on_results is not None:
            on_results(done)

    related = None
    if args.index_related:
        pool = list(dict.fromkeys(p for ex in examples for p in ex.passages))
        related = {pool[i]: [pool[j] for j in js] for i, js in enumerate(related_passages(pool, args.index_related))}
    evaluator = BlendEvaluator(llm, max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                               index_alone=args.chunk_store == "alone", kl_tokens=args.kl_tokens, related=related,
                               miss_passages=args.miss_passages, before_ask=before_ask)
    return run_questions(evaluator, examples, modes, warm_up=not args.no_warmup, desc="bench", unit="req",
                         on_measurement=show_answer, on_question=show_question)


def print_report(results, summaries: list[ModeSummary], modes: list[Mode], args, counters: dict) -> None:
    tokens = [r.prompt_tokens for r in results]
    print(f"\n== Blend benchmark: {len(results)} questions, prompts of {min(tokens)}-{max(tokens)} tokens "
          f"(mean {statistics.mean(tokens):.0f}), {args.max_tokens} answer tokens ==")
    print(f"indexing step (all passages of a question, batched): median "
          f"{statistics.median(r.index_s for r in results):.2f}s\n")
    print(format_tables(summaries))
    by_name = {s.mode: s for s in summaries}
    full = by_name.get("full prefill")
    blend = by_name.get(blend_mode(args.ratio, args.selections[0]).name)
    if full and blend and blend.speedup:
        print(f"\nmedian TTFT: full prefill {full.median_ttft_s:.3f}s, {blend.mode} {blend.median_ttft_s:.3f}s "
              f"-> speed-up {blend.speedup:.2f}x (full / blend)")
    print("\n" + TABLE_NOTES)
    if counters:
        print("\nUCM connector counters of the whole run (indexing and warm-up included):\n" + format_counters(counters))


NO_MATPLOTLIB = "matplotlib is not installed: no plot written (the JSON holds the same numbers)"


def _pyplot():
    """matplotlib.pyplot on the file backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plot(path: Path, summaries: list[ModeSummary]) -> str | None:
    """TTFT and quality against the ratio, full prefill as reference lines; a message if skipped."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    full = next((s for s in summaries if s.ratio is None), None)
    # One curve per selection rule; ratio 0 and 1 rank nothing and belong to every curve.
    shared = [s for s in summaries if s.ratio is not None and s.selection is None]
    rules = list(dict.fromkeys(s.selection for s in summaries if s.selection is not None)) or ["query"]
    curves = {rule: sorted(shared + [s for s in summaries if s.selection == rule], key=lambda s: s.ratio)
              for rule in rules}
    if not shared and not any(s.selection for s in summaries):
        return "no Blend ratio measured: no plot written"
    fig, (ax_t, ax_q) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"query": "C0", "hkvd": "C1", "oracle": "C2"}
    for rule, blend in curves.items():
        x, c = [s.ratio for s in blend], colors.get(rule)
        label = "Blend" if rule == "query" else f"Blend ({rule})"
        ax_t.plot(x, [s.median_ttft_s for s in blend], "o-", color=c, label=f"{label}, median")
        ax_q.plot(x, [s.f1_vs_full or 0.0 for s in blend], "s-", color=c, label=f"{label}: F1 vs full-prefill answer")
        ax_q.plot(x, [s.f1_gold for s in blend], "o:", color=c, alpha=0.6, label=f"{label}: F1 vs gold")
    if full:
        ax_t.axhline(full.median_ttft_s, color="grey", ls="--", label="full prefill (median)")
    ax_t.set(xlabel="recompute ratio", ylabel="TTFT (s)", title="Time to first token", ylim=(0, None))
    ax_t.legend()
    if full:
        ax_q.axhline(full.f1_gold, color="grey", ls="--", label="full prefill F1 vs gold")
    ax_q.set(xlabel="recompute ratio", ylabel="score", title="Answer quality", ylim=(0, 1.05))
    ax_q.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_frontier(path: Path, summaries: list[ModeSummary]) -> str | None:
    """Quality (next-token KL, agreement) against median TTFT, one series per rule; full prefill
    and full reuse as reference points; a message if skipped."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax_kl, ax_ag) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[ModeSummary]] = {}
    for s in summaries:
        series.setdefault(s.selection or s.mode, []).append(s)
    for i, (name, points) in enumerate(series.items()):
        points = sorted(points, key=lambda s: s.median_ttft_s)
        style = "o-" if len(points) > 1 else "*"
        x = [s.median_ttft_s for s in points]
        if any(s.kl_vs_full is not None for s in points):
            ax_kl.plot(x, [s.kl_vs_full if s.kl_vs_full is not None else float("nan") for s in points], style,
                       color=f"C{i}", label=name, markersize=10 if style == "*" else 5)
        ax_ag.plot(x, [s.agree_pct if s.agree_pct is not None else 100.0 for s in points], style, color=f"C{i}",
                   label=name, markersize=10 if style == "*" else 5)
    ax_kl.set(xlabel="median TTFT (s)", ylabel="next-token KL to full prefill", title="Divergence (lower is better)",
              yscale="log")
    ax_ag.set(xlabel="median TTFT (s)", ylabel="answers equal to full prefill's (%)", title="Agreement",
              ylim=(0, 105))
    for ax in (ax_kl, ax_ag):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


if __name__ == "__main__":
    sys.exit(main())
