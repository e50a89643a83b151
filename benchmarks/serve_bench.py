"""Blend under serving load: vLLM's OpenAI server with the UCM connector, many RAG requests at once.

Starts `ucm-vllm serve` on 127.0.0.1 with vLLM's default scheduler settings (chunked prefill on,
the default step budget) and the README's connector config, indexes every question's passages
(one request per passage alone, as an indexing step would), then, at each concurrency, sends
every question with its passages in reverse order, once with Blend and once with Blend off for
the request (`ucm_disable_blend`: the connector's own cost, it still looks up and stores), and
then the same prompts on plain vLLM (a server without the connector, prefix caching on, the same
cores; the baseline Blend is reported against). Blend requests share the indexing requests' `cache_salt` (one
tenant: chunk KV is shared within a tenant only; the passages were indexed alone, so no exact
prefix of a measured prompt is cached); Blend-off requests each get their own, so no cache
serves them; plain vLLM's requests share one per phase, so its prefix cache serves what a phase's
requests share (not the same prompts asked in an earlier phase). Every request states its chunks (`ucm_chunk_lengths`), so the question is computed
by every request. TTFT is the time to the first streamed token.

    python benchmarks/serve_bench.py                          # 8 questions, concurrency 1,2,4,8
    python benchmarks/serve_bench.py --num-questions 4 --concurrency 1,4

Reports per mode and concurrency: TTFT p50/p90, requests/s and prompt tokens/s over the phase,
the share of requests blended and the fallbacks (from the server's /metrics), and whether the
answers under load are those of the same prompts at concurrency 1. Writes JSON as it goes and a
PNG (TTFT p50 against requests/s). Data: ../shared/data/musique_dev.json when present, else
generated questions of 10 passages x ~450 words.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _serving import (DTYPE, blend_config, counters, free_port, load_examples, percentile, start_server,
                      stop_server, wait_healthy)
from ucm.config import KV_SHIFT_DEFAULT
from ucm.argparse_help import HelpFormatter
from ucm.eval.summary import host_record

DEFAULT_OUT = Path(tempfile.gettempdir()) / "serve_bench.json"  # results to keep: --out benchmarks/results/...
RATIO = 0.15
TENANT = "serve-bench"  # cache_salt of the indexing and the Blend requests


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"), help="model directory (env MODEL_PATH; none: the embedded one)")
    p.add_argument("--num-questions", type=int, default=8)
    p.add_argument("--skip-questions", type=int, default=0, help="start at this question of the data set")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--generated", action="store_true", help="generated questions even if MuSiQue is present")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=DTYPE,
                   help="the servers' --dtype (bfloat16 is the faster on CPUs with native bfloat16)")
    p.add_argument("--serve-args", default="", help="extra `vllm serve` flags, e.g. '--max-num-batched-tokens 8192'")
    p.add_argument("--no-plain", action="store_true", help="skip the plain vLLM server (no baseline without the connector)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    return p.parse_args(argv)


async def one_request(client, model, prompt, salt, mode: str, max_tokens: int) -> dict:
    """mode: "blend"; "full" (Blend off through the connector); "plain" (vLLM without the connector)."""
    token_ids, chunk_lengths = prompt
    kv = {"ucm_chunk_lengths": chunk_lengths}
    if mode == "full":
        kv["ucm_disable_blend"] = True
    extra = {"cache_salt": salt} if mode == "plain" else {"cache_salt": salt, "kv_transfer_params": kv}
    start = time.perf_counter()
    ttft, text = None, ""
    stream = await client.completions.create(model=model, prompt=token_ids, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            if ttft is None:
                ttft = time.perf_counter() - start
            text += chunk.choices[0].text
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start,
            "latency": time.perf_counter() - start, "text": text}


async def run_phase(client, model, prompts, concurrency: int, tag: str, mode: str, max_tokens: int) -> dict:
    """Every prompt once, at most `concurrency` in flight; returns per-request results and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i, prompt):
        async with sem:
            # Blend requests share one tenant (the indexing one): chunk KV is shared only within a
            # tenant. Blend-off requests get a salt each, so no cache serves them.
            # Plain vLLM's requests share a salt per phase: its prefix cache serves what the phase's
            # requests share, not the same prompts of an earlier phase.
            salt = TENANT if mode == "blend" else tag if mode == "plain" else f"{tag}-{i}"
            return await one_request(client, model, prompt, salt, mode, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(guarded(i, ids) for i, ids in enumerate(prompts)))
    return {"wall_s": time.perf_counter() - start, "requests": results}


def summarize(phase: dict, prompt_tokens: int, before: dict, after: dict) -> dict:
    ttfts = [r["ttft"] for r in phase["requests"]]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    n = len(ttfts)
    return {
        "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": percentile(ttfts, 0.9),
        "requests_per_s": n / phase["wall_s"], "prompt_tokens_per_s": prompt_tokens / phase["wall_s"],
        "wall_s": phase["wall_s"], "requests": n,
        "blended": int(delta.get("blended_requests", 0)),
        "fallbacks": {k: int(v) for k, v in delta.items() if k.startswith("blend_fallbacks_")},
        "deferrals": int(delta.get("blend_deferrals", 0)),
        "refused_params": int(delta.get("request_params_refused", 0)),  # must stay 0: the config allows them
        "answers": [r["text"] for r in phase["requests"]],
    }


def load_prompts(args, tokenizer):
    """(data set name, indexing prompts, measured prompts); each prompt is (token ids, chunk lengths).

    Indexing sends every passage alone (the canonical context: its stored KV depends on no other
    text); the measured prompts state their chunks (system message, passages), so the question is
    the suffix every request computes, as a user's new question would be.
    """
    from ucm.eval.prompts import build_prompt, chunk_end_token_id

    dataset, examples = load_examples(args.generated, args.num_questions, args.skip_questions)
    marker = chunk_end_token_id(tokenizer)
    index, reordered = [], []
    for ex in examples:
        order = list(range(len(ex.passages)))
        prompt = build_prompt(tokenizer, ex, marker, order=order)
        start = prompt.chunk_lengths[0]
        for n in prompt.chunk_lengths[1:]:
            index.append((prompt.token_ids[start:start + n], [n]))
            start += n
        rev = build_prompt(tokenizer, ex, marker, order=order[::-1])
        reordered.append((rev.token_ids, list(rev.chunk_lengths)))
    return dataset, index, reordered


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("blend", "o"), ("full", "s")):
        rows = [r for r in results["phases"] if r["mode"] == mode]
        ax.plot([r["requests_per_s"] for r in rows], [r["ttft_p50_s"] for r in rows], marker=marker,
                label="Blend 0.15" if mode == "blend" else "Blend off (full prefill)")
        for r in rows:
            ax.annotate(f"c={r['concurrency']}", (r["requests_per_s"], r["ttft_p50_s"]), fontsize=8)
    ax.set_xlabel("requests/s")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_yscale("log")
    ax.set_title(f"ucm-vllm serve, {results['dataset']}, ~{results['mean_prompt_tokens']:.0f}-token prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        print_table(json.loads(Path(args.table).read_text()))
        return 0
    from transformers import AutoTokenizer

    from ucm.models import prepare

    model = args.model or str(prepare())
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset, index, prompts = load_prompts(args, tokenizer)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    results = {"dataset": dataset, "questions": len(prompts), "mean_prompt_tokens": prompt_tokens / len(prompts),
               "ratio": RATIO, "dtype": args.dtype, "kv_shift": KV_SHIFT_DEFAULT, "serve_args": args.serve_args, "max_tokens": args.max_tokens, "phases": [],
               "host": host_record()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = tempfile.mkdtemp(prefix="ucm-serve-bench-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(out.with_suffix(".server.log"), "w")
    from ucm.eval.prompts import chunk_end_token_id

    ktc = blend_config(store, RATIO, ["ucm_chunk_lengths", "ucm_disable_blend"],
                       chunk_end_token_id=chunk_end_token_id(tokenizer))
    proc = start_server(model, port, args.serve_args.split(), log, ktc, dtype=args.dtype)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        wait_healthy(url, proc)
        asyncio.run(measure(url, index, prompts, levels, args.max_tokens, prompt_tokens, results, out))
        stop_server(proc)
        proc = None
        if not args.no_plain:
            proc = start_server(model, port, args.serve_args.split(), log, None, dtype=args.dtype)
            wait_healthy(url, proc)
            asyncio.run(measure_plain(url, index[:1], prompts, levels, args.max_tokens, prompt_tokens, results, out))
        print_table(results)
        if not args.no_plot:
            plot(results, out.with_suffix(".png"))
    finally:
        if proc is not None:
            stop_server(proc)
        log.close()
        subprocess.run(["rm", "-rf", store], check=False)
    return 0


async def measure(url, index, prompts, levels, max_tokens, prompt_tokens, results, out) -> None:
    """The indexing pass, then every concurrency level with Blend on and off; JSON after each phase."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    name = (await client.models.list()).data[0].id
    t = time.perf_counter()
    await run_phase(client, name, index, 4, "index", "blend", 1)
    print(f"indexed {len(index)} passages in {time.perf_counter() - t:.0f} s", flush=True)
    reference = None
    for c in levels:
        for mode in ("blend", "full"):
            before = counters(url)
            phase = await run_phase(client, name, prompts, c, f"{mode}-c{c}", mode, max_tokens)
            row = {"mode": mode, "concurrency": c, **summarize(phase, prompt_tokens, before, counters(url))}
            if mode == "blend":
                reference = reference or row["answers"]
                row["same_answers_as_concurrency_1"] = sum(a == b for a, b in zip(row["answers"], reference))
            results["phases"].append(row)
            print(f"{mode:5s} c={c}: TTFT p50 {row['ttft_p50_s']:.2f} s p90 {row['ttft_p90_s']:.2f} s, "
                  f"{row['requests_per_s']:.3f} req/s, {row['prompt_tokens_per_s']:.0f} prompt tok/s, blended "
                  f"{row['blended']}/{row['requests']}, fallbacks {row['fallbacks'] or 0}, "
                  f"deferrals {row['deferrals']}", flush=True)
            out.write_text(json.dumps(results, indent=1))


async def measure_plain(url, warmup, prompts, levels, max_tokens, prompt_tokens, results, out) -> None:
    """The measured prompts on plain vLLM at every concurrency, after `warmup` (untimed, as the
    Blend server had its indexing pass: a passage alone, so it shares no prefix with them)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    name = (await client.models.list()).data[0].id
    await run_phase(client, name, warmup, 1, "plain-warmup", "plain", 1)
    for c in levels:
        phase = await run_phase(client, name, prompts, c, f"plain-c{c}", "plain", max_tokens)
        row = {"mode": "plain", "concurrency": c, **summarize(phase, prompt_tokens, {}, {})}
        results["phases"].append(row)
        print(f"plain c={c}: TTFT p50 {row['ttft_p50_s']:.2f} s p90 {row['ttft_p90_s']:.2f} s, "
              f"{row['requests_per_s']:.3f} req/s", flush=True)
        out.write_text(json.dumps(results, indent=1))


def print_table(results: dict) -> None:
    by = {(r["mode"], r["concurrency"]): r for r in results["phases"]}
    print("\n| concurrency | blended | TTFT p50 on / off | speed-up | req/s on / off | throughput gain | same answers "
          "| req/s plain vLLM | gain over plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in sorted({r["concurrency"] for r in results["phases"]}):
        on, off, plain = by.get(("blend", c)), by.get(("full", c)), by.get(("plain", c))
        if not on or not off:
            continue
        over_plain = (f"{plain['requests_per_s']:.3f} | {on['requests_per_s'] / plain['requests_per_s']:.2f}x"
                      if plain else "- | -")
        print(f"| {c} | {on['blended']}/{on['requests']} | {on['ttft_p50_s']:.2f} s / {off['ttft_p50_s']:.2f} s | "
              f"{off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x | {on['requests_per_s']:.3f} / {off['requests_per_s']:.3f} | "
              f"{on['requests_per_s'] / off['requests_per_s']:.2f}x | {on['same_answers_as_concurrency_1']}/{on['requests']} "
              f"| {over_plain} |")


if __name__ == "__main__":
    sys.exit(main())
