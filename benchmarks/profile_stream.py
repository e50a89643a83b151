"""Where a server's engine spends its time on a RAG stream: py-spy samples of every process of a
`rag_traffic.py` run, the engine core's samples split by what they were doing.

    python benchmarks/profile_stream.py --out benchmarks/results/profile_fresh.json -- \\
        --fresh --servers blend --num-requests 12 --warmup 1 --concurrency 2

Everything after `--` goes to rag_traffic.py. py-spy (`pip install py-spy`) samples the whole
process tree at --rate Hz; the engine core's samples (vLLM's EngineCore process, which on CPU runs
the model too) are sorted into the connector's parts (scheduler side: lookups, planning; worker
side: loads, dumps; the store), the Blend forward, vLLM's model forward, vLLM's scheduler and
idle, by the innermost frame that names one of them. Printed as a table and written as JSON with
the 40 heaviest connector functions.
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
    ("store (ucm/store)", "/ucm/store/"),
    ("connector: scheduler side", "/connector/scheduler_side.py"),
    ("connector: scheduler side", "/connector/store_view.py"),
    ("connector: scheduler side", "/connector/request_plan.py"),
    ("connector: scheduler side", "/connector/dump_plan.py"),
    ("connector: scheduler side", "/connector/blend_first_scheduler.py"),
    ("connector: scheduler side", "/connector/approximate_hashes.py"),
    ("connector: worker side", "/connector/worker_side.py"),
    ("connector: worker side", "/connector/rank_agreement.py"),
    ("connector: other", "/connector/"),
    ("Blend forward", "/ucm/integration/vllm/blend/"),
    ("Blend algorithm (ucm/sparse)", "/ucm/sparse/"),
    ("vLLM model forward", "/vllm/model_executor/"),
    ("vLLM attention", "/vllm/v1/attention/"),
    ("vLLM scheduler", "/vllm/v1/core/"),
    ("vLLM worker / runner", "/vllm/v1/worker/"),
]
IDLE = ("select", "poll", "wait (threading.py", "_recv", "recv_multipart", "get (queue.py", "sleep")


def classify(frames: list[str]) -> str:
    """The part of the innermost frame that names one, scanning from the leaf up."""
    for frame in reversed(frames):
        for part, needle in PARTS:
            if needle in frame:
                return part
    leaf = frames[-1] if frames else ""
    return "idle (waiting)" if any(w in leaf for w in IDLE) else "other"


def connector_function(frames: list[str]) -> str | None:
    """The outermost ucm frame of a sample (the connector entry point vLLM called), with its leaf."""
    for frame in frames:
        if "/ucm/" in frame:
            return frame.split(" (")[0] + " (" + frame.split("/ucm/")[-1]
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=int, default=25, help="samples per second and process (default: 25)")
    p.add_argument("--out", default=None, help="JSON with the breakdown")
    args = p.parse_args(own)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        p.error("py-spy not found: pip install py-spy")
    raw = Path(tempfile.mkdtemp(prefix="ucm-profile-")) / "samples.txt"
    cmd = [spy, "record", "--subprocesses", "--idle", "--format", "raw", "--rate", str(args.rate), "-o", str(raw),
           "--", sys.executable, str(HERE / "rag_traffic.py"), "--no-plot", *rest]
    started = time.time()
    rc = subprocess.call(cmd)
    if not raw.exists():
        print(f"py-spy wrote no samples (rc {rc})", file=sys.stderr)
        return 1
    parts: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or "EngineCore" not in stack.split(";")[0]:
            continue
        frames = stack.split(";")[1:]
        n = int(count)
        total += n
        parts[classify(frames)] += n
        fn = connector_function(frames)
        if fn:
            functions[fn] += n
    if not total:
        print("no engine core samples found (is the server's engine process named EngineCore?)", file=sys.stderr)
        return 1
    busy = total - parts["idle (waiting)"]
    print(f"engine core: {total} samples at {args.rate} Hz, {busy} busy")
    print(f"{'part':36s} {'share of samples':>16s} {'share of busy':>14s}")
    for part, n in parts.most_common():
        print(f"{part:36s} {100 * n / total:15.1f}% {'' if part.startswith('idle') else f'{100 * n / busy:13.1f}%'}")
    print("heaviest connector entry points (share of busy samples):")
    for fn, n in functions.most_common(15):
        print(f"  {100 * n / busy:5.1f}%  {fn}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": rest, "rate_hz": args.rate, "engine_core_samples": total, "busy_samples": busy,
            "parts": dict(parts.most_common()), "connector_entry_points": dict(functions.most_common(40)),
            "duration_s": round(time.time() - started, 1)}, indent=1))
        print(f"wrote {args.out}")
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    raise SystemExit(main())
