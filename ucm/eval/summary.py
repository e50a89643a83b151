"""Summaries of a run: per-mode statistics with bootstrap intervals, tables, the results JSON."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ucm.eval.metrics import bootstrap_ci
from ucm.eval.measure import Measurement, QuestionResult
from ucm.config import KV_SHIFT_DEFAULT
from ucm.eval.modes import DEFAULT_CHECK_LAYER, FULL_PREFILL, Mode


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
    load_seconds: float = 0.0
    # Paired with full prefill question by question: this mode's F1 gold minus full prefill's.
    f1_gold_delta: float | None = None
    # 95% bootstrap intervals over the questions (None for full prefill itself or one question).
    f1_gold_delta_ci: tuple[float, float] | None = None
    f1_vs_full_ci: tuple[float, float] | None = None
    agree_pct_ci: tuple[float, float] | None = None
    # Mean next-token KL to full prefill over the first answer tokens (None unless measured).
    kl_vs_full: float | None = None
    kl_vs_full_ci: tuple[float, float] | None = None

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
        kls = [x.kl_vs_full for x in rows if x.kl_vs_full is not None]
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
            load_bytes=int(counted("load_bytes")), load_seconds=float(counted("load_seconds")),
            f1_gold_delta=statistics.mean(deltas) if deltas else None, f1_gold_delta_ci=bootstrap_ci(deltas),
            f1_vs_full_ci=bootstrap_ci(vs_full), agree_pct_ci=bootstrap_ci([100.0 * a for a in agree]),
            kl_vs_full=statistics.mean(kls) if kls else None, kl_vs_full_ci=bootstrap_ci(kls),
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

    with_kl = any(s.kl_vs_full is not None for s in summaries)
    header = ["mode", "n", "F1 gold - full prefill", "F1 vs full", "agree"] + (["next-token KL"] if with_kl else [])
    rows = [[
        s.mode, str(s.n), with_ci(s.f1_gold_delta, s.f1_gold_delta_ci, "+.3f"),
        with_ci(s.f1_vs_full, s.f1_vs_full_ci, ".3f"), with_ci(s.agree_pct, s.agree_pct_ci, ".0f", "%"),
    ] + ([with_ci(s.kl_vs_full, s.kl_vs_full_ci, ".4f")] if with_kl else []) for s in summaries if s.ratio is not None]
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
        f"{s.load_bytes / 1e6:.1f}", f"{1000 * s.load_seconds / s.n:.0f}" if s.load_seconds else "-", str(s.dumped_blocks),
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
    "Modes: 'blend R' recomputes the share R of the loaded tokens ranked by the question's attention\n"
    "(selection 'query'), 'hkvd R' by their KV deviation (CacheBlend's rule), 'oracle R' by a\n"
    "full prefill run first (a reference for quality; its TTFT includes that prefill); full reuse = 0.\n"
    "Second table: F1 gold minus full prefill's, question by question, and the quality columns with their\n"
    "95% bootstrap intervals over the questions (one question more or less moves small samples a lot).\n"
    "Cache table: blended, chunk hit blocks / tokens, dumped blocks: totals of the connector's per-request\n"
    "reports (kv_transfer_params['ucm']); recomputed tok (share of the loaded chunk tokens), loaded MB, load\n"
    "ms/req: the connector's statistics counters (vLLM's KV connector stats, vllm:ucm_*) during the requests."
)


@functools.cache
def started_at_commit() -> str | None:
    """The checkout's commit at the first call (a run calls it when it starts), with "+dirty" for
    uncommitted changes under ucm/ or csrc/; None outside git."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ucm", "csrc"], cwd=repo, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode else "")


def cpu_isa() -> str:
    """The widest x86 ISA level this CPU has for vLLM's kernels (amx, avx512_bf16, avx512f, avx2 or
    the machine's name), probed through torch as bfloat16_note does: results from hosts of
    different levels are not comparable in seconds."""
    import torch

    for probe, name in ((torch.cpu._is_amx_tile_supported, "amx"), (torch.cpu._is_avx512_bf16_supported, "avx512_bf16"),
                        (torch.cpu._is_avx512_supported, "avx512f"), (torch.cpu._is_avx2_supported, "avx2")):
        if probe():
            return name
    return platform.machine()


def host_record() -> dict:
    """Where and from what code a benchmark ran: its JSON's `host`."""
    return {"commit": started_at_commit(), "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


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
            "kv_shift": args.kv_shift if getattr(args, "kv_shift", None) is not None else KV_SHIFT_DEFAULT,
            "chunk_start_tokens": {m.name: m.chunk_start_tokens for m in modes if m.chunk_start_tokens},
            "index_related": getattr(args, "index_related", 0),
            "miss_passages": getattr(args, "miss_passages", 0),
            "min_question_tokens": getattr(args, "min_question_tokens", 0),
            "check_layer": getattr(args, "check_layer", DEFAULT_CHECK_LAYER),
            "enforce_eager": getattr(args, "enforce_eager", False),  # runs before 2026-11-29 (no key) were eager
            "later_checks": [list(c) for c in getattr(args, "later_checks", ())],
            "layerwise": getattr(args, "layerwise", None),  # None: the config's default
            "store_medium": getattr(args, "store_medium", None),  # None: a directory (a --store-dir or a temporary one)
            "commit": started_at_commit(),
            "skip_questions": getattr(args, "skip_questions", 0),  # "question" i below is question skip + i of the set
            "machine": platform.machine(), "cpu_isa": cpu_isa(),
            "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "duration_s": round(time.time() - started, 1),
        },
        "prompt_tokens": {"min": min(tokens), "max": max(tokens), "mean": statistics.mean(tokens)},
        "summary": [s.to_dict() for s in summaries],
        "counters": counters,
        "questions": [{"question": r.question, "prompt_tokens": r.prompt_tokens, "index_s": r.index_s,
                       # prompt tokens of each indexing request (a passage, after its context if any)
                       "index_prompt_tokens": [rep.get("prompt_tokens") for rep in r.index_reports],
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
