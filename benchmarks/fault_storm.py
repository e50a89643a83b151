"""A storm of faults through `ucm-vllm serve`: every stage of the cache path fails on a share of its
calls while concurrent clients send RAG requests. The server must answer every request, each
answer must be plain vLLM's, and the store must hold no wrong block afterwards.

    python benchmarks/fault_storm.py                                  # at least 100 faults
    python benchmarks/fault_storm.py --faults 20 --num-questions 8    # a quick one

Blend runs at ratio 1.0 (every loaded token recomputed), so its answers are full prefill's: an
answer that differs from plain vLLM's is a fault that leaked into the KV, not Blend's
approximation. A round asks every question three times: with its passages in a new order (chunks
hit, Blend), in another new order with Blend off for the request (`ucm_disable_blend`: computed in
full, its exact blocks stored), and as the previous round's Blend-off prompt again (its exact
prefix loaded from the store). Phases: plain vLLM (no connector) answers every round's prompts;
the Blend server (README config at ratio 1.0, every block stored on first sighting, one store
directory) indexes the passages alone with no fault, then runs rounds with the faults on
(`UCM_FAULTS`, `stage~P` words: each stage fails on a share of its calls) until at least --faults
faults were injected (counted from the server's log), then one round with the faults off (blending
must resume); then the store is audited (`python -m ucm.integration.vllm.audit`: every EXACT block
of the prompts recomputed and compared). Writes JSON as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _serving import (DTYPE, blend_config, counters, free_port, load_examples, start_server, stop_server,
                      wait_healthy)
from serve_bench import TENANT, one_request
from ucm.argparse_help import HelpFormatter
from ucm.eval.summary import host_record
from ucm.integration.vllm.faults import FAULTS_ENV, STAGES

DEFAULT_OUT = Path(tempfile.gettempdir()) / "fault_storm.json"
# Share of each stage's calls that fail. `attention` is called once per layer of every subset pass,
# so its share is per layer; the others are per step or per request.
DEFAULT_SHARES = {"lookup": 0.05, "load": 0.1, "rotate": 0.1, "select": 0.1, "forward": 0.1, "attention": 0.003,
                  "dump": 0.05}
INJECTED = re.compile(r"fault injected at stage '(\w+)'")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="model directory or name (default: the embedded one)")
    p.add_argument("--num-questions", type=int, default=24)
    p.add_argument("--generated", action="store_true", help="generated questions even if MuSiQue is present")
    p.add_argument("--passages", type=int, default=10, help="passages per generated question")
    p.add_argument("--passage-words", type=int, default=80, help="words per generated passage")
    p.add_argument("--faults", type=int, default=100, help="faults to inject at least")
    p.add_argument("--max-rounds", type=int, default=8, help="rounds with faults at most")
    p.add_argument("--shares", default=",".join(f"{s}~{p}" for s, p in DEFAULT_SHARES.items()),
                   help="UCM_FAULTS words: stage~share, comma-separated")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=DTYPE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    for word in args.shares.split(","):
        stage, _, share = word.partition("~")
        if stage not in STAGES:
            p.error(f"--shares: unknown stage {stage!r}; stages: {', '.join(STAGES)}")
        try:
            float(share)
        except ValueError:
            p.error(f"--shares: {word!r} needs a share, e.g. {stage}~0.1")
    return args


def build_rounds(args, tokenizer):
    """(indexing prompts, rounds): a round is a list of (prompt, mode), a prompt (token ids, chunk
    lengths): each question with its passages in a new order (Blend), in another (Blend off), and
    the previous round's Blend-off prompt again."""
    from ucm.eval.prompts import build_prompt, chunk_end_token_id

    _, examples = load_examples(args.generated, args.num_questions, passages=args.passages,
                                passage_words=args.passage_words)
    marker = chunk_end_token_id(tokenizer)
    rng = random.Random(args.seed)
    index, rounds = [], [[] for _ in range(args.max_rounds + 1)]
    for ex in examples:
        prompt = build_prompt(tokenizer, ex, marker, order=list(range(len(ex.passages))))
        start = prompt.chunk_lengths[0]
        for n in prompt.chunk_lengths[1:]:
            index.append((prompt.token_ids[start:start + n], [n]))
            start += n
        previous = None
        for prompts in rounds:
            drawn = []
            for _ in range(2):
                order = list(range(len(ex.passages)))
                rng.shuffle(order)
                p = build_prompt(tokenizer, ex, marker, order=order)
                drawn.append((p.token_ids, list(p.chunk_lengths)))
            prompts += [(drawn[0], "blend"), (drawn[1], "full")] + ([(previous, "full")] if previous else [])
            previous = drawn[1]
    return index, rounds


def injected(log_path: Path, start: int) -> Counter:
    """Faults injected since byte `start` of the server's log, by stage (one line names each)."""
    with open(log_path, errors="replace") as f:
        f.seek(start)
        return Counter(m.group(1) for line in f for m in [INJECTED.search(line)] if m)


async def answers(url: str, prompts, concurrency: int, max_tokens: int, plain: bool = False) -> list[str | None]:
    """Every (prompt, mode)'s answer, at most `concurrency` in flight; None where the request failed."""
    from openai import AsyncOpenAI

    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900) as client:
        name = (await client.models.list()).data[0].id

        async def one(i, prompt, mode):
            async with sem:
                try:
                    return (await one_request(client, name, prompt, TENANT, "plain" if plain else mode,
                                              max_tokens))["text"]
                except Exception as exc:  # noqa: BLE001 - counted: the server must answer every request
                    print(f"request {i} failed: {type(exc).__name__}: {exc}", flush=True)
                    return None

        return await asyncio.gather(*(one(i, p, mode) for i, (p, mode) in enumerate(prompts)))


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from ucm.eval.prompts import chunk_end_token_id
    from ucm.models import model_path

    model = str(model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    index, rounds = build_rounds(args, tokenizer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"model": Path(model).name, "dtype": args.dtype, "questions": args.num_questions,
               "mean_prompt_tokens": sum(len(ids) for (ids, _), _ in rounds[0]) / len(rounds[0]),
               "concurrency": args.concurrency, "shares": args.shares, "target_faults": args.faults,
               "rounds": [], "host": host_record()}
    store = tempfile.mkdtemp(prefix="ucm-fault-storm-")
    faults_file = Path(store + ".faults")
    faults_file.write_text("")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out.with_suffix(".server.log")
    log = open(log_path, "w")
    proc = None
    try:
        proc = start_server(model, port, [], log, None, dtype=args.dtype)
        wait_healthy(url, proc)
        t = time.perf_counter()
        plain = [asyncio.run(answers(url, prompts, args.concurrency, args.max_tokens, plain=True))
                 for prompts in rounds]
        print(f"plain vLLM answered {len(rounds)} rounds in {time.perf_counter() - t:.0f} s", flush=True)
        stop_server(proc)
        ktc = blend_config(store, 1.0, ["ucm_chunk_lengths", "ucm_disable_blend"],
                           blend_extra={"admission": "first_sighting"},
                           chunk_end_token_id=chunk_end_token_id(tokenizer))
        proc = start_server(model, port, [], log, ktc, env_extra={FAULTS_ENV: str(faults_file)}, dtype=args.dtype)
        wait_healthy(url, proc)
        asyncio.run(answers(url, [(p, "blend") for p in index], args.concurrency, 1))
        total = Counter()
        for r in range(len(rounds) - 1):  # faults on until enough were injected, then a round with them off
            total += run_round(url, rounds, plain, r, args, faults_file, log, log_path, results, out, storm=True)
            if sum(total.values()) >= args.faults:
                break
        run_round(url, rounds, plain, len(rounds) - 1, args, faults_file, log, log_path, results, out, storm=False)
        stop_server(proc)
        proc = None
        results["audit"] = audit(store, rounds, index, args, model, out)
        results["injected"] = dict(total)
        results["faults"] = sum(total.values())
        results["answered"] = sum(r["answered"] for r in results["rounds"])
        results["requests"] = sum(r["requests"] for r in results["rounds"])
        results["same_as_plain"] = sum(r["same_as_plain"] for r in results["rounds"])
        out.write_text(json.dumps(results, indent=1))
        a = results["audit"]
        print(f"\n{results['faults']} faults injected {dict(total)}; {results['answered']}/{results['requests']} "
              f"requests answered, {results['same_as_plain']} as plain vLLM; audit: {a.get('compared')} blocks "
              f"compared ({a.get('missing')} of the prompts' blocks not in the store), {len(a.get('bad', []))} bad "
              f"(exit status {a['exit_status']})")
    finally:
        if proc is not None:
            stop_server(proc)
        log.close()
        subprocess.run(["rm", "-rf", store, str(faults_file)], check=False)
    return 0


def run_round(url, rounds, plain, r, args, faults_file: Path, log, log_path: Path, results: dict, out: Path,
              storm: bool) -> Counter:
    """Round r's prompts with the faults on (`storm`) or off; appends its row; the faults it injected."""
    prompts = rounds[r]
    faults_file.write_text(args.shares.replace(",", " ") if storm else "")
    log.flush()
    start, before = log_path.stat().st_size, counters(url)
    texts = asyncio.run(answers(url, prompts, args.concurrency, args.max_tokens))
    time.sleep(1.0)  # the last step's dumps and logs
    log.flush()
    faults, after = injected(log_path, start), counters(url)
    delta = {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v != before.get(k, 0.0)}
    row = {"round": r, "faults_on": storm, "requests": len(texts), "answered": sum(t is not None for t in texts),
           "same_as_plain": sum(a == b for a, b in zip(texts, plain[r])),
           "different": [(i, prompts[i][1]) for i, (a, b) in enumerate(zip(texts, plain[r])) if a != b],
           "injected": dict(faults), "counters": delta}
    results["rounds"].append(row)
    out.write_text(json.dumps(results, indent=1))
    print(f"round {r} ({'faults on' if storm else 'faults off'}): {row['same_as_plain']}/{row['requests']} "
          f"as plain vLLM, {sum(faults.values())} faults {dict(faults)}, blended "
          f"{delta.get('blended_requests', 0)}, fallbacks "
          f"{ {k: v for k, v in delta.items() if k.startswith('blend_fallbacks_')} }", flush=True)
    return faults


def audit(store: str, rounds, index, args, model: str, out: Path) -> dict:
    """The audit's report of the store (every EXACT block of the prompts recomputed), with its exit status."""
    prompts_file = out.with_suffix(".prompts.jsonl")
    with open(prompts_file, "w") as f:
        for ids, _ in [*index, *(p for prompts in rounds for p, _ in prompts)]:
            f.write(json.dumps({"prompt_token_ids": ids, "cache_salt": TENANT}) + "\n")
    report = out.with_suffix(".audit.json")
    done = subprocess.run([sys.executable, "-m", "ucm.integration.vllm.audit", "--store", store, "--prompts",
                           str(prompts_file), "--model", model, "--dtype", args.dtype, "--json", str(report)],
                          capture_output=True, text=True)
    result = json.loads(report.read_text()) if report.exists() else {"error": done.stderr[-2000:]}
    result["exit_status"] = done.returncode
    prompts_file.unlink(missing_ok=True)
    report.unlink(missing_ok=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
