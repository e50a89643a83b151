"""Where a server's engine spends its time on a RAG stream: py-spy samples of every process of a
`rag_traffic.py` run, vLLM's processes' samples split by what they were doing.

    python benchmarks/profile_stream.py --out benchmarks/results/profile_fresh.json -- \\
        --fresh --servers blend --num-requests 12 --warmup 1 --concurrency 2

Everything after `--` goes to rag_traffic.py. py-spy (`pip install py-spy`) samples the whole
process tree at --rate Hz; the samples of vLLM's processes are sorted into the connector's parts (scheduler side: lookups, planning; worker
side: loads, dumps; the store), the Blend forward, vLLM's model forward, vLLM's scheduler and
idle, by the innermost frame that names one of them. Printed as a table and written as JSON with
the 40 heaviest connector functions. On CPU vLLM runs the model in a Worker process beside the
EngineCore (scheduler): each is summarized on its own. `--samples RAW` summarizes an earlier
run's raw file again. The worker's samples inside a Blend step are also split by phase (the probe,
attention in the native kernel and in vLLM's, the KV shift, the layers' other work).
`--script blend_bench.py` profiles the offline benchmark instead (its engine has the same two
processes):

    python benchmarks/profile_stream.py --script blend_bench.py -- --dtype bfloat16 --num-questions 4 \\
        --sweep --ratios 0.15 --selections query --max-tokens 1 --enforce-eager
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (part, substring of a frame "function (file:line)"), innermost match wins; checked in order.
PARTS = [
    ("store (ucm/store)", "ucm/store/"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/scheduler_side.py"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/store_view.py"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/request_plan.py"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/dump_plan.py"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/blend_first_scheduler.py"),
    ("connector: scheduler side", "ucm/integration/vllm/connector/approximate_hashes.py"),
    ("connector: worker side", "ucm/integration/vllm/connector/worker_side.py"),
    ("connector: worker side", "ucm/integration/vllm/connector/rank_agreement.py"),
    ("connector: other", "ucm/integration/vllm/connector/"),
    ("Blend forward", "ucm/integration/vllm/blend/"),
    ("Blend algorithm (ucm/sparse)", "ucm/sparse/"),
    ("vLLM model forward", "vllm/model_executor/"),
    ("vLLM attention", "vllm/v1/attention/"),
    ("vLLM scheduler", "vllm/v1/core/"),
    ("vLLM worker / runner", "vllm/v1/worker/"),
]
# Leaf frames of a thread that waits (py-spy's --idle keeps them: a sample there is no work). The
# store's IO threads are native, so py-spy sees neither their waits nor their work.
IDLE = ("Condition.wait (threading.py", "select (selectors.py", "Poller.poll (zmq", "_serve (ucm/store/deadline.py",
        "main (multiprocessing/resource_tracker.py", "Connection._recv (multiprocessing", "sched_yield (vllm/",
        "_worker (concurrent/futures/thread.py", "Runner.run (asyncio", "sleep", "Event.wait (threading.py")


# A Blend step's phases: (phase, substring of a frame), the first found anywhere in the sample wins.
# The probe's own attention counts as the probe; the layers' attention is split by kernel.
BLEND_STEP = "blend_forward ("  # a frame of blend_forward.blend_forward (not of check_blend_forward)
BLEND_PHASES = [
    ("probe and ranking", "_score_loaded_rows ("),
    ("KV shift", "ucm/sparse/blend/kv_shift.py"),
    ("KV shift", "KVShiftPlan."),
    ("attention: native kernel (scattered rows)", "paged_causal_attention ("),
    ("attention: torch tiles (scattered rows)", "tiled_causal_attention ("),
    ("attention: vLLM's kernel (runs of rows)", "SubsetAttentionImpl.forward ("),
    ("layers: projections, norms, MLP", "run_subset ("),
    ("layers: projections, norms, MLP", "run_layers ("),
]


def blend_step_phase(frames: list[str]) -> str | None:
    """The phase of a Blend step a busy sample is in, or None outside a Blend step."""
    if not any(f.startswith(BLEND_STEP) for f in frames):
        return None
    stack = ";".join(frames)
    for phase, marker in BLEND_PHASES:
        if marker in stack:
            return phase
    return "other (batch, selection, metadata)"


def _path(frame: str) -> str:
    """The file of a frame "function (path:line)", relative to site-packages or the repository."""
    path = frame[frame.rfind("(") + 1:]
    for root in ("site-packages/", "/ucm/"):
        if root in path:
            path = path[path.index(root) + len(root):] if root == "site-packages/" else "ucm/" + path.split("/ucm/", 1)[1]
    return path


def classify(frames: list[str]) -> str:
    """Idle when the thread waits (its leaf frame is a wait), else the part of the innermost frame
    that names one, scanning from the leaf up."""
    if not frames or any(w in frames[-1] for w in IDLE):
        return "idle (waiting)"
    for frame in reversed(frames):
        path = _path(frame)
        for part, prefix in PARTS:
            if path.startswith(prefix):
                return part
    return "other"


def connector_function(frames: list[str]) -> str | None:
    """The outermost ucm frame of a sample (the connector entry point vLLM called), with its leaf."""
    for frame in frames:
        if _path(frame).startswith("ucm/"):
            return f"{frame.split(' (')[0]} ({_path(frame)}"
    return None


# vLLM's processes by how many spawned processes deep they are under the server (py-spy shows the
# command line they started with, before vLLM renames them): the EngineCore, then its Worker.
PROCESSES = (("engine core (scheduler)", 1), ("worker (model, connector's worker side)", 2))
SPAWNED = "multiprocessing.spawn"


def summarize(raw: Path) -> dict:
    """Per vLLM process (engine core, worker): samples by part, and the connector's entry points."""
    out = {}
    for label, depth in PROCESSES:
        parts: collections.Counter[str] = collections.Counter()
        functions: collections.Counter[str] = collections.Counter()
        phases: collections.Counter[str] = collections.Counter()
        for line in raw.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            # With --subprocesses each sample starts with its process and its ancestors: "process PID:"cmdline"".
            chain = [i for i, f in enumerate(frames) if f.startswith("process ")]
            if not chain or sum(SPAWNED in frames[i] for i in chain) != depth or SPAWNED not in frames[chain[-1]]:
                continue
            frames = frames[chain[-1] + 1:]
            part = classify(frames)
            parts[part] += int(count)
            fn = None if part.startswith("idle") else connector_function(frames)
            if fn:
                functions[fn] += int(count)
            phase = None if part.startswith("idle") else blend_step_phase(frames)
            if phase:
                phases[phase] += int(count)
        total = sum(parts.values())
        out[label] = {"samples": total, "busy_samples": total - parts["idle (waiting)"],
                      "parts": dict(parts.most_common()), "connector_entry_points": dict(functions.most_common(40)),
                      "blend_step_phases": dict(phases.most_common())}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=int, default=25, help="samples per second and process (default: 25)")
    p.add_argument("--samples", default=None, metavar="RAW",
                   help="summarize this py-spy raw file of an earlier run instead of running one")
    p.add_argument("--out", default=None, help="JSON with the breakdown")
    p.add_argument("--script", default="rag_traffic.py", choices=("rag_traffic.py", "blend_bench.py"),
                   help="the benchmark to run under py-spy (default: rag_traffic.py)")
    args = p.parse_args(own)
    started = time.time()
    rc = 0
    if args.samples:
        raw = Path(args.samples)
    else:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not os.path.exists(spy):
            p.error("py-spy not found: pip install py-spy")
        raw = Path(tempfile.mkdtemp(prefix="ucm-profile-")) / "samples.txt"
        cmd = [spy, "record", "--subprocesses", "--idle", "--format", "raw", "--rate", str(args.rate), "-o", str(raw),
               "--", sys.executable, str(HERE / args.script), "--no-plot", *rest]
        rc = subprocess.call(cmd)
        print(f"samples: {raw}")
    if not raw.exists():
        print(f"py-spy wrote no samples (rc {rc})", file=sys.stderr)
        return 1
    processes = summarize(raw)
    if not any(p["samples"] for p in processes.values()):
        print("no samples of vLLM's engine core or worker processes found", file=sys.stderr)
        return 1
    for label, data in processes.items():
        total, busy = data["samples"], data["busy_samples"]
        rate = "" if args.samples else f" at {args.rate} Hz"  # an earlier run's rate is not in its raw file
        print(f"\n{label}: {total} samples{rate}, {busy} busy")
        for part, n in data["parts"].items():
            share = "" if part.startswith("idle") else f"{100 * n / max(busy, 1):6.1f}% of busy"
            print(f"  {part:40s} {100 * n / max(total, 1):6.1f}%  {share}")
        steps = sum(data["blend_step_phases"].values())
        if steps:
            print(f"  inside Blend steps: {steps} samples ({100 * steps / max(busy, 1):.1f}% of busy)")
            for phase, n in data["blend_step_phases"].items():
                print(f"    {100 * n / steps:5.1f}%  {phase}")
        print("  heaviest connector entry points (share of busy samples):")
        for fn, n in list(data["connector_entry_points"].items())[:12]:
            print(f"    {100 * n / max(busy, 1):5.1f}%  {fn}")
    if args.out:
        from ucm.eval.summary import host_record

        Path(args.out).write_text(json.dumps({
            "script": args.script, "command": rest, "rate_hz": None if args.samples else args.rate, "processes": processes, "host": host_record(),
            "duration_s": None if args.samples else round(time.time() - started, 1)}, indent=1))
        print(f"wrote {args.out}")
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    raise SystemExit(main())
