"""The fixed quality check: run it whenever the Blend forward, the selection or the scheduler changes.

Blend's default rule against full prefill and against CacheBlend's HKVD rule at the same ratio,
by next-token KL to full prefill's distribution (the first answer token) on a fixed generated
set (16 questions, 10 passages of 120 words, passages indexed first), then compared with the
accepted result committed in benchmarks/results/quality_check.json:

    python benchmarks/quality_check.py                  # ~15 min on 2 cores; exit 1 on a regression
    python benchmarks/quality_check.py --accept         # record this run as the new accepted result
    python benchmarks/quality_check.py --model DIR      # another model (compared with nothing)

A regression is the default rule's mean KL above the accepted one by more than --tolerance
(default 25%: runs on different CPUs differ in rounding, not by that much), or above HKVD's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ACCEPTED = REPO / "benchmarks" / "results" / "quality_check.json"
BENCH_ARGS = ["--generated", "--num-questions", "16", "--passages", "10", "--passage-words", "120", "--ratio", "0.15",
              "--selections", "query,hkvd", "--kl-tokens", "1", "--no-plot",
              "--enforce-eager"]  # Blend's error alone: full prefill runs the same layer code, not a compiled graph
DEFAULT_MODE, PEER_MODE = "blend 0.15", "hkvd 0.15"


def kl_of(result: dict) -> dict[str, float]:
    return {s["mode"]: s["kl_vs_full"] for s in result["summary"] if s.get("kl_vs_full") is not None}


def verdict(run: dict, accepted: dict | None, tolerance: float) -> list[str]:
    """The regressions of `run` (empty: none): the default rule's KL against HKVD's and the accepted run's."""
    kl = kl_of(run)
    problems = []
    if kl[DEFAULT_MODE] > kl[PEER_MODE]:
        problems.append(f"the default rule's KL {kl[DEFAULT_MODE]:.4f} is above HKVD's {kl[PEER_MODE]:.4f}")
    if accepted is not None and Path(accepted["config"]["model"]).name == Path(run["config"]["model"]).name:
        before = kl_of(accepted)[DEFAULT_MODE]
        if kl[DEFAULT_MODE] > before * (1 + tolerance):
            problems.append(f"the default rule's KL {kl[DEFAULT_MODE]:.4f} is above the accepted {before:.4f} "
                            f"(commit {accepted['config'].get('commit')}) by more than {tolerance:.0%}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="/tmp/quality_check.json", help="this run's JSON")
    p.add_argument("--accept", action="store_true", help=f"copy this run to {ACCEPTED.relative_to(REPO)}")
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--compare", metavar="JSON", help="compare an existing run's JSON instead of running")
    args = p.parse_args(argv)
    if args.compare:
        run_path = Path(args.compare)
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import blend_bench

        bench = BENCH_ARGS + ["--out", args.out] + (["--model", args.model] if args.model else [])
        if blend_bench.main(bench):
            return 2
        run_path = Path(args.out)
    run = json.loads(run_path.read_text())
    accepted = json.loads(ACCEPTED.read_text()) if ACCEPTED.is_file() else None
    kl = kl_of(run)
    print(f"\nquality check ({run['config'].get('commit')}): next-token KL to full prefill, "
          + ", ".join(f"{mode} {value:.4f}" for mode, value in kl.items()))
    if accepted is not None:
        print(f"accepted ({accepted['config'].get('commit')}): "
              + ", ".join(f"{mode} {value:.4f}" for mode, value in kl_of(accepted).items()))
    problems = verdict(run, accepted, args.tolerance)
    for line in problems:
        print(f"REGRESSION: {line}")
    if args.accept:
        ACCEPTED.write_text(run_path.read_text())
        print(f"recorded as {ACCEPTED.relative_to(REPO)}")
    elif not problems:
        print("no regression")
    return 1 if problems and not args.accept else 0


if __name__ == "__main__":
    sys.exit(main())
