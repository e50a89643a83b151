"""The main job and the benchmark, run as a user runs them (real engine, generated data, 1 question)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True, env=env,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_main_job_reports_every_mode_and_removes_its_store(model_dir, tmp_path):
    result = tmp_path / "main.json"
    out = _run("examples/offline_inference_blend.py", "--num-questions", "1", "-q", "--selections", "query,hkvd",
               "--out", str(result), env_extra={"MODEL_PATH": str(model_dir), "TMPDIR": str(tmp_path)})
    table = out.stdout[out.stdout.index("mode "):]
    for mode in ("full prefill", "blend 0.3", "full reuse", "hkvd 0.3"):
        assert mode in table
    # Each mode's last row is its row of the cache table (the one after the TTFT table).
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines() if line[:1].isalpha()}
    # Every Blend mode blended its one request, loading the chunks the indexing step stored.
    for mode in ("blend 0.3", "full reuse", "hkvd 0.3"):
        assert " 1/1 " in rows[mode], table
    assert "removed the temporary store" in out.stdout
    data = json.loads(result.read_text())
    assert {s["mode"] for s in data["summary"]} == {"full prefill", "blend 0.3", "full reuse", "hkvd 0.3"}
    [question] = data["questions"]
    assert len(question["measurements"]) == 4 and all(m["answer"] is not None for m in question["measurements"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ucm-blend-store-")]


def test_benchmark_sweep_with_related_indexing_writes_json(model_dir, tmp_path):
    """The benchmark's ratio sweep, with --index-related 1 (FusionRAG-style indexing): each passage
    is stored after its most similar passage of the run, as one context chunk, so every indexing
    request holds about two passages; the measured prompts still find every passage under its own
    hash and blend it. One run for both (an engine start each would cost a minute)."""
    result = tmp_path / "bench.json"
    _run("benchmarks/blend_bench.py", "--generated", "--num-questions", "2", "--passages", "3",
         "--passage-words", "80", "--index-related", "1", "--sweep", "--ratios", "0,0.15,1", "--no-plot",
         "--out", str(result), env_extra={"MODEL_PATH": str(model_dir)})
    data = json.loads(result.read_text())
    summary = {s["mode"]: s for s in data["summary"]}
    assert set(summary) >= {"full prefill", "full reuse", "blend 0.15", "blend 1", "hkvd 0.15"}
    assert all(s["n"] == 2 for s in summary.values())
    for mode in ("full reuse", "blend 0.15", "blend 1"):
        assert summary[mode]["blended"] == 2 and summary[mode]["chunk_hit_tokens"] > 0
    # Ratio 1 recomputes every loaded token: the answer is full prefill's.
    assert summary["blend 1"]["agree_pct"] == 100.0
    assert summary["blend 0.15"]["recomputed_tokens"] < summary["blend 1"]["recomputed_tokens"]
    assert data["config"]["index_related"] == 1
    for q in data["questions"]:
        reuse = next(m for m in q["measurements"] if m["mode"] == "full reuse")
        passages = reuse["report"]["chunk_hit_tokens"]
        assert passages > 0 and len(q["index_prompt_tokens"]) == 3
        # Alone, the indexing requests would hold the passages once (plus the system chunk each).
        assert sum(q["index_prompt_tokens"]) > 1.8 * passages, (q["index_prompt_tokens"], passages)
