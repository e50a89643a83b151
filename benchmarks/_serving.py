"""What the serving benchmarks share (serve_bench.py, rag_traffic.py): a `ucm-vllm serve` process
on 127.0.0.1 (with the README's connector config or none), its /metrics counters, percentiles and
the questions (MuSiQue from ../shared/data when present, else generated)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ucm.config import KV_SHIFT_DEFAULT

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"
DTYPE = "float32"  # the server's --dtype, recorded in the JSON


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blend_config(store: str, ratio: float, request_params: list[str], store_extra: dict | None = None,
                 blend_extra: dict | None = None, chunk_end_token_id: int = 2) -> dict:
    """The README's connector config: one UcmNfsStore in `store`, Blend at `ratio` on layer 1
    (`store_extra`, `blend_extra`: more keys of the store's config and of ucm_sparse_config.Blend);
    `chunk_end_token_id`: the model's `<|im_end|>` (2 in SmolLM2's vocabulary)."""
    store_config: dict = {"storage_backends": store, **(store_extra or {})}
    return {"kv_connector": "UCMConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore", "ucm_connector_config": store_config}],
        "ucm_sparse_config": {"Blend": {"chunk_end_token_id": chunk_end_token_id,
                                        "compute_meta": {"model.layers.1.self_attn.attn": {"ratio": ratio,
                                                                                         "kv_shift": KV_SHIFT_DEFAULT}},
                                        # what the benchmark's clients set per request (the operator's call)
                                        "request_params": request_params, **(blend_extra or {})}}}}


def start_server(model: str, port: int, extra: list[str], log, ktc: dict | None,
                 env_extra: dict[str, str] | None = None, dtype: str = DTYPE) -> subprocess.Popen:
    """`ucm-vllm serve` in a session of its own (stop_server ends the group). ktc None: plain vLLM,
    no connector and vLLM's own model classes. env_extra: set in the server's environment (over ours)."""
    # vLLM reserves one core for its scheduler, and one more when a KV connector is configured; on
    # 2 cores that leaves plain vLLM one compute core and a connector's server both (it reserves
    # none when the count reaches the total). Same cores for every server: none reserved.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), **(env_extra or {})}
    kv = ["--kv-transfer-config", json.dumps(ktc)] if ktc is not None else []
    if ktc is None:
        env["UCM_BLEND_NO_MODELS"] = "1"
    # vLLM's compiled forward, as a server gets by default (runs before 2026-11-29 passed --enforce-eager to
    # both servers: `--serve-args=--enforce-eager` repeats them)
    cmd = [sys.executable, "-m", "ucm.integration.vllm.cli", "serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", dtype, *kv, *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start; see its log")
            time.sleep(1)


def counters(url: str) -> dict[str, float]:
    """The connector's counters from /metrics (vllm:ucm_<name>_total), summed over engines."""
    return parse_counters(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


def parse_counters(text: str) -> dict[str, float]:
    """vllm:ucm_<name>_total counters of a Prometheus text exposition, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter" and family.name.startswith("vllm:ucm_"):
            name = family.name[len("vllm:ucm_"):]
            out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def load_examples(generated: bool, limit: int, skip: int = 0, passages: int = 10, passage_words: int = 450):
    """(data set name, questions): MuSiQue when present and not `generated`, else generated
    questions of `passages` x ~`passage_words` words."""
    from ucm.eval.datasets import load_dataset

    path = None if generated or not DEFAULT_DATASET.is_file() else DEFAULT_DATASET
    examples = load_dataset(path, limit=limit, skip=skip, passages_per_example=passages, passage_words=passage_words)
    return ("MuSiQue" if path else "generated"), examples


async def sample_rss(pids: list[int], into: list, every_s: float = 10.0) -> None:
    """Appends (seconds since the start, resident MB of the processes and all their children) every
    `every_s` until cancelled: a server's memory over a run."""
    import asyncio

    import psutil

    start = time.monotonic()
    while True:
        total = 0
        for pid in pids:
            try:
                procs = [psutil.Process(pid)]
                procs += procs[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        into.append((round(time.monotonic() - start, 1), round(total / 2**20)))
        await asyncio.sleep(every_s)
