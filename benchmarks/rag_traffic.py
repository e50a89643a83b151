"""Blend on a RAG request stream: plain vLLM (prefix caching, no connector) against the README's
connector config (Blend 0.15, a temporary store; --capacity-gb its size limit), one server after the
other, the same stream (same seed) to each of --servers.

Each request asks one of the first --questions questions, drawn from a Zipf popularity (rank r with
weight 1 / r^a), its passages shuffled and --noise of them replaced by other questions' passages.
--fresh: no passage is sent twice (questions in data set order). Every request of a run has the
same cache_salt on both servers (one tenant, a new one per run); Blend requests state their chunks
(ucm_chunk_lengths), so the question is always computed. --index first sends each passage alone.

    python benchmarks/rag_traffic.py                                  # 100 requests, concurrency 2
    python benchmarks/rag_traffic.py --rates 0.05,0.1 --capacity-gb 1 --out benchmarks/results/rag_traffic.json
    python benchmarks/rag_traffic.py --num-requests 4 --generated --passages 4 --passage-words 200

Per request, with its send time: TTFT (latency less vLLM's decode time: the connector's report,
kv_transfer_params["ucm"], comes only with unstreamed responses), chunk blocks and hits, blended,
vLLM's cached prompt tokens (Blend: loaded chunk KV included). Per run: chunk hit rate, blended
share, TTFT p50/p90 overall and of high-hit requests (>= 80% of chunk blocks hit on the Blend run,
the same requests on plain), requests/s, wall time, store bytes written and read, fallbacks, the
store's size at the end and the blocks dumped but not in it (evicted, refused, or dumped twice at
once); JSON as it goes, a PNG of TTFT over time, and Blend's speed-up over plain.

--alone N: after each Blend run, up to N of its high-hit requests (evenly spread over the stream)
are sent again one at a time to the idle server, same tenant, and their TTFT alone is set against
their TTFT in the stream (the run's `alone` records; summary `high_hit_vs_alone`: the median of
stream / alone over those requests). Alone, a request finds at least the chunks it found in the
stream (the store only grew, by its own misses too: the summary gives both hit rates, and the
ratio overstates the stream's cost by what those misses cost alone; vLLM's prefix cache may hold
its exact prefix, as in the stream) and nothing else runs: what the stream added is waiting and
sharing steps. So each is sent twice: first with every chunk it missed in the stream made new
(one token changed: the same length and work, `alone_same_misses`, summary
`high_hit_vs_alone_same_misses`), then as it was (`alone`).

--instances N (two instances, one store): each server is N `ucm-vllm serve` instances, each on its
own port; Blend's all use the same store directory, plain's each keep their own prefix cache. The
stream goes round robin from the one client at the same load: request k to instance k % N (--index
too: the k-th passage alone to instance k % N). With N > 1, instance i's worker threads are bound
to the i % C-th of the C cores this process may run on (VLLM_CPU_OMP_THREADS_BIND, one core each;
N = 1 keeps vLLM's automatic binding). Each record says its instance; each run reports chunk hit
rate and vLLM's cached share per instance, and, to approximate cross-instance hits (chunk blocks an
instance loads that another one dumped; the store does not say who wrote a block), counts from the
stream and the routing alone, per request: its passages (by passage id) sent before it, in stream
order, only ever to other instances (passages_first_seen_elsewhere); the run reports their total,
how many requests have any, and the chunk hit rate of those requests against the rest. Earlier in
stream order is not always finished: at concurrency c up to c - 1 earlier requests may still be
running, their KV not yet stored, so this over-counts. Store traffic counters are summed over the
instances.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from _mount_schedule import MountSchedule, mounted_store, window_summary
from _serving import (DTYPE, blend_config, counters, free_port, load_examples, percentile, sample_rss, start_server,
                      stop_server, wait_healthy)
from ucm.argparse_help import HelpFormatter
from ucm.eval.metrics import paired_speedup, top_k_kl
from ucm.eval.summary import host_record

DEFAULT_OUT = Path(tempfile.gettempdir()) / "rag_traffic.json"  # results to keep: --out benchmarks/results/...
RATIO = 0.15
TENANT = "rag-traffic"  # cache_salt prefix; a run adds its load level
HIGH_HIT = 0.8
SERVERS = ("plain", "blend")
SERVE_FLAGS = ["--enable-prefix-caching", "--enable-per-request-metrics", "--enable-prompt-tokens-details"]


def _list(kind):  # "1,2" -> [1, 2]; argparse converts string defaults too
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"),
                   help="model directory or a name of ucm.models (qwen2.5-coder-0.5b, ...), env MODEL_PATH; None: the embedded one")
    p.add_argument("--num-requests", type=int, default=100, help="requests in the stream")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=DTYPE,
                   help="both servers' --dtype (bfloat16 is the faster on CPUs with native bfloat16)")
    p.add_argument("--ratio", type=float, default=RATIO,
                   help=f"Blend's recompute ratio (default {RATIO}, that of every earlier run of this benchmark)")
    p.add_argument("--questions", type=int, default=50, help="questions the Zipf popularity is over")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent a: rank r drawn with weight 1 / r^a")
    p.add_argument("--noise", type=int, default=2, help="passages per request replaced by other questions' passages")
    p.add_argument("--fresh", action="store_true", help="no passage is sent twice (0%% reuse)")
    p.add_argument("--passages", type=int, default=10, help="passages per question (MuSiQue: its first N)")
    p.add_argument("--passage-words", type=int, default=450, help="words per generated passage")
    p.add_argument("--generated", action="store_true", help="generated questions even if MuSiQue is present")
    p.add_argument("--concurrency", type=_list(int), default="2", help="comma-separated concurrency levels")
    p.add_argument("--rates", type=_list(float), default=None,
                   help="comma-separated Poisson arrival rates (requests/s), instead of --concurrency")
    p.add_argument("--capacity-gb", type=float, default=None, help="store size limit (Blend's capacity_gb)")
    p.add_argument("--index", action="store_true", help="send every passage of the stream alone first (untimed)")
    p.add_argument("--servers", type=_list(str), default=",".join(SERVERS), help="comma-separated: plain, blend")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--alone", type=int, default=8, metavar="N",
                   help="after each Blend run, send up to N of its high-hit requests again one at a time (0: none)")
    p.add_argument("--logprobs", type=int, default=0, metavar="K",
                   help="record each answer's first-token top-K log-probabilities (K <= the server's max_logprobs, "
                        "20): Blend's next-token KL to plain vLLM's run of the same stream (a lower bound)")
    p.add_argument("--seed", type=int, default=0, help="of the stream and the arrival times")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="untimed requests per server instance before its runs (the stream's first prompts under a "
                        "tenant of their own: nothing they store is reused); a fresh server's first prompts run up to "
                        "2x slower, which otherwise lands in TTFT p90")
    p.add_argument("--blend-config", default="{}",
                   help='more ucm_sparse_config.Blend keys (JSON), e.g. \'{"max_step_tokens": 8192}\'')
    p.add_argument("--store-config", default="{}",
                   help='more keys of Blend\'s UcmNfsStore config (JSON), e.g. \'{"io_threads": 16}\'')
    p.add_argument("--connector-config", default="{}",
                   help='more kv_connector_extra_config keys of the Blend server (JSON), e.g. \'{"prefetch_chunks": "auto"}\'')
    p.add_argument("--serve-args", default="", help="extra `vllm serve` flags for both servers")
    p.add_argument("--mount", default=None, metavar="SPEC",
                   help="Blend's store behind a FUSE mount that misbehaves (benchmarks/_mount_schedule.py): e.g. "
                   "'latency_ms=5', or 'hang=open+read+write@60/300' (those calls hang from 60 s into each run for "
                   "300 s); each run then reports its requests/s in that window and after it, and memory over time")
    p.add_argument("--instances", type=int, default=1, metavar="N",
                   help="instances per server (Blend's on one store), requests round robin: request k to "
                        "instance k %% N; N > 1: instance i's worker threads on core i %% (cores we may use) "
                        "(VLLM_CPU_OMP_THREADS_BIND, replacing any set)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON; the PNG and server logs go beside it")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    args = p.parse_args(argv)
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"unknown --servers {', '.join(sorted(unknown))}")
    if args.instances < 1:
        p.error("--instances must be at least 1")
    if not 0 <= args.ratio <= 1:
        p.error(f"--ratio must be in [0, 1], got {args.ratio}")
    return args


@dataclass(frozen=True)
class Request:
    question: int  # index into the questions
    passages: tuple[int, ...]  # passage ids in prompt order
    noise: tuple[int, ...] = ()  # positions holding passages of other questions


def passage_pool(examples) -> tuple[list[str], list[list[int]]]:
    """(unique passage texts, each question's passage ids): a passage two questions share is one id."""
    ids: dict[str, int] = {}
    questions = [[ids.setdefault(p, len(ids)) for p in ex.passages] for ex in examples]
    return list(ids), questions


def zipf_weights(n: int, a: float) -> list[float]:
    return [1.0 / r ** a for r in range(1, n + 1)]


def fresh_questions_needed(num_requests: int, noise: int, passages: int) -> int:
    return num_requests + math.ceil(num_requests * noise / max(passages, 1)) + 1


def _add_noise(rng: random.Random, own: list[int], donors: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`own` shuffled, then len(donors) random positions given to the donors."""
    order = rng.sample(own, len(own))
    positions = sorted(rng.sample(range(len(order)), len(donors)))
    for pos, donor in zip(positions, donors):
        order[pos] = donor
    return tuple(order), tuple(positions)


def make_stream(questions: list[list[int]], num_requests: int, zipf_a: float = 1.1, noise: int = 2, seed: int = 0,
                fresh: bool = False) -> list[Request]:
    """The requests, deterministic in `seed`. Popular: question ranks drawn from Zipf(zipf_a), donors
    any passage of another question. Fresh: questions taken in order, donors from the last
    questions (never asked then); no passage id appears in two requests or twice in one."""
    rng = random.Random(seed)
    if any(noise > len(q) for q in questions):
        raise ValueError(f"--noise {noise} is more than a question's passages")
    if fresh:
        return _fresh_stream(rng, questions, num_requests, noise)
    weights = zipf_weights(len(questions), zipf_a)
    stream = []
    for q in rng.choices(range(len(questions)), weights, k=num_requests):
        own = set(questions[q])
        others = sorted({p for j, ps in enumerate(questions) if j != q for p in ps} - own)
        if len(others) < noise:
            raise ValueError("too few other passages for --noise: use more --questions")
        stream.append(Request(q, *_add_noise(rng, questions[q], rng.sample(others, noise))))
    return stream


def _fresh_stream(rng, questions, num_requests, noise) -> list[Request]:
    used: set[int] = set()  # sent, or set aside as donors
    spare: list[int] = []  # donor passages, from the last questions (never asked then)
    front, back, stream = 0, len(questions) - 1, []
    for _ in range(num_requests):
        while len(spare) < noise and back > front:
            new = [p for p in dict.fromkeys(questions[back]) if p not in used]
            spare, back = spare + new, back - 1
            used.update(new)
        while front <= back and used & set(questions[front]):
            front += 1
        if front > back or len(spare) < noise:
            raise ValueError(f"--fresh: {len(questions)} questions are too few for {num_requests} requests "
                             "(fewer --num-requests or --generated)")
        used.update(questions[front])
        stream.append(Request(front, *_add_noise(rng, questions[front], [spare.pop() for _ in range(noise)])))
        front += 1
    return stream


def routing(num_requests: int, instances: int) -> list[int]:
    """The instance of each request: round robin in stream order, request k to instance k % instances."""
    return [k % instances for k in range(num_requests)]


def passages_first_seen_elsewhere(requests, routes) -> list[int]:
    """Per request (its passage ids, sent to instance routes[k]): how many of its distinct passages
    were sent before it, in this order, but never to its own instance. A passage new to the stream,
    or sent to its instance before, is not counted."""
    sent_to: dict[int, set[int]] = {}  # passage id -> instances it was sent to
    counts = []
    for passages, instance in zip(requests, routes, strict=True):
        distinct = set(passages)
        counts.append(sum(1 for p in distinct if p in sent_to and instance not in sent_to[p]))
        for p in distinct:
            sent_to.setdefault(p, set()).add(instance)
    return counts


def stream_passages(stream) -> list[int]:
    """Every passage id of the stream once, in order of first use (the --index order)."""
    return list(dict.fromkeys(p for req in stream for p in req.passages))


def core_binding(instances: int, cpus) -> list[dict[str, str]]:
    """Extra environment of each instance: none for one instance (vLLM binds automatically), else
    instance i's worker threads on cpus[i % len(cpus)]."""
    if instances == 1:
        return [{}]
    cpus = sorted(cpus)
    return [{"VLLM_CPU_OMP_THREADS_BIND": str(cpus[i % len(cpus)])} for i in range(instances)]


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Poisson arrivals: n send times (s) with exponential gaps of mean 1 / rate."""
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


async def send(http, model: str, prompt, salt: str, blend: bool, max_tokens: int, logprobs: int = 0) -> dict:
    token_ids, chunk_lengths = prompt
    body = {"model": model, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt}
    if logprobs:  # the first answer token's top-k, keyed by token id (two ids may print alike)
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    if blend:
        body["kv_transfer_params"] = {"ucm_chunk_lengths": chunk_lengths}
    start = time.perf_counter()
    resp = await http.post("/v1/completions", json=body)
    latency = time.perf_counter() - start
    resp.raise_for_status()
    out = resp.json()
    decode = ((out.get("metrics") or {}).get("generation_time_ms") or 0.0) / 1000  # first to last token
    report = (out.get("kv_transfer_params") or {}).get("ucm") or {}
    details = out["usage"].get("prompt_tokens_details") or {}
    first = {} if not logprobs else {"first_logprobs": [
        [int(tok.rsplit(":", 1)[1]), lp] for tok, lp in out["choices"][0]["logprobs"]["top_logprobs"][0].items()]}
    return {**first, "ttft_s": latency - decode, "latency_s": latency, "prompt_tokens": out["usage"]["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens"), "chunk_blocks": report.get("chunk_blocks", 0),
            "chunk_hit_blocks": report.get("chunk_hit_blocks", 0), "chunk_hits": report.get("chunk_hits", []),
            "blended": bool(report.get("blended")),
            "fallback": report.get("fallback"), "text": out["choices"][0]["text"]}


async def warm_up(clients, model: str, prompts, n: int, blend: bool) -> None:
    """Sends each instance the stream's first n prompts, untimed, under a tenant of their own (what
    they store is never reused by the stream's tenant)."""
    for client in clients:
        for k in range(n):
            await send(client, model, prompts[k % len(prompts)], f"{TENANT}-warmup", blend, 1)


async def run_stream(clients, model, prompts, salt, blend, max_tokens, level, seed, on_record, logprobs=0) -> float:
    """Every prompt in order, at fixed concurrency or at its Poisson arrival time, prompt i to
    clients[i % len(clients)]; the wall time."""
    kind, value = level
    start = time.perf_counter()
    routes = routing(len(prompts), len(clients))

    async def one(i):
        sent = time.perf_counter() - start
        rec = await send(clients[routes[i]], model, prompts[i], salt, blend, max_tokens, logprobs)
        on_record({"i": i, "start_s": sent, **rec, "end_s": time.perf_counter() - start})

    if kind == "concurrency":  # `value` workers take the prompts in order
        queue = iter(range(len(prompts)))

        async def worker():
            for i in queue:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(value)))
    else:  # open loop: each prompt at its arrival time, whatever is still running
        tasks = []
        for i, at in enumerate(arrival_times(len(prompts), value, seed + 1)):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return time.perf_counter() - start


def sum_counters(urls) -> dict[str, float]:
    """The connector's counters summed over instances."""
    out: dict[str, float] = {}
    for url in urls:
        for k, v in counters(url).items():
            out[k] = out.get(k, 0.0) + v
    return out


def store_summary(before: dict, after: dict, store: str | None) -> dict:
    """The run's store traffic and fallbacks (/metrics deltas) and the store's blocks at its end."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    files = list(Path(store).rglob("*.kvb")) if store else []
    return {"dump_bytes": int(delta.get("dump_bytes", 0)), "load_bytes": int(delta.get("load_bytes", 0)),
            # worker time: before the forward (loads), after it (dumps); scheduler time in lookups
            "load_s": delta.get("load_seconds", 0.0), "load_wait_s": delta.get("load_wait_seconds", 0.0),
            "dump_s": delta.get("dump_seconds", 0.0),
            "lookup_s": delta.get("lookup_seconds", 0.0), "lookup_rounds": int(delta.get("lookup_rounds", 0)),
            "fallbacks": {k: int(v) for k, v in delta.items() if k.startswith("blend_fallbacks_") and v},
            # steps whose Blend rows passed max_step_tokens (the scheduler admits within it: 0 expected)
            "blend_steps_over_cap": int(delta.get("blend_steps_over_cap", 0)),
            # chunks computed alone while the server was idle (background_chunks, chunk_store "alone")
            "background": {k: int(v) for k, v in delta.items() if k.startswith("background_chunks_") and v},
            # admission: segments seen for the first time (a sighting written instead of their KV) and
            # the computed blocks not stored for it
            "sightings_stored": int(delta.get("sightings_stored", 0)),
            "blocks_not_admitted": int(delta.get("blocks_not_admitted", 0)),
            "store_bytes": sum(f.stat().st_size for f in files), "store_blocks": len(files),
            # blocks dumped since the server started less those in the store: evicted, refused under
            # capacity_gb, or one block dumped by two requests at once (the store has no eviction counter)
            "dumped_not_in_store": max(0, int(after.get("dumped_blocks", 0)) - len(files))}


def high_hit_requests(records) -> set[int]:
    return {r["i"] for r in records if r["chunk_blocks"] and r["chunk_hit_blocks"] >= HIGH_HIT * r["chunk_blocks"]}


def hit_rate(records) -> float | None:
    """Chunk blocks hit / chunk blocks; None without chunk blocks."""
    blocks = sum(r["chunk_blocks"] for r in records)
    return sum(r["chunk_hit_blocks"] for r in records) / blocks if blocks else None


def alone_picks(records, n: int) -> list[int]:
    """Up to n high-hit requests of a run, evenly spread over the stream (by request index)."""
    high = sorted(high_hit_requests(records))
    if n <= 0 or not high:
        return []
    step = max(1, len(high) / n)
    return sorted({high[min(len(high) - 1, int(k * step))] for k in range(min(n, len(high)))})


def with_same_misses(prompt, chunk_hits, seed: int):
    """The prompt with the first token of every chunk that had no block hit in the stream replaced
    by another of the chunk's tokens (random, seeded): every block hash of such a chunk changes, so
    alone the request misses what it missed in the stream and does the same work (the same length,
    the same chunk layout). Chunks hit in part stay as they are: alone they may hit more."""
    token_ids, chunk_lengths = prompt
    ends = list(itertools.accumulate(chunk_lengths))
    chunk_end = dict(zip([0] + ends[:-1], ends))  # chunk start -> end
    rng, out = random.Random(seed), list(token_ids)
    for start, _, hit in chunk_hits:
        if hit or start not in chunk_end:
            continue
        others = [t for t in token_ids[start + 1:chunk_end[start]] if t != token_ids[start]]
        if others:
            out[start] = rng.choice(others)
    return out, chunk_lengths


def alone_summary(records, alone, key: str = "alone") -> dict:
    """The high-hit requests sent again alone: their TTFT p50 alone and in the stream, and the
    median over them of stream TTFT / alone TTFT (the issue's target: within 2x). `key` names the
    variant: "alone" (the request as it was), "alone_same_misses" (its stream misses kept missing)."""
    if not alone:
        return {}
    stream = {r["i"]: r for r in records}
    again = [a for a in alone if a["i"] in stream and a["ttft_s"] > 0]
    pairs = [(stream[a["i"]]["ttft_s"], a["ttft_s"]) for a in again]
    return {f"{key}_requests": len(pairs),
            # "alone": a request also finds the chunks it stored itself in the stream: fewer misses
            f"{key}_chunk_hit_rate": hit_rate(again),
            f"{key}_stream_chunk_hit_rate": hit_rate([stream[a["i"]] for a in again]),
            f"{key}_ttft_p50_s": percentile([b for _, b in pairs], 0.5) if pairs else None,
            f"{key}_stream_ttft_p50_s": percentile([a for a, _ in pairs], 0.5) if pairs else None,
            f"high_hit_vs_{key}": percentile([a / b for a, b in pairs], 0.5) if pairs else None}


def kl_summary(records, reference) -> dict:
    """First answer token's KL(reference || records), request by request (top_k_kl: a lower bound
    from the top-K lists), over the requests both runs recorded lists for; {} without any."""
    ref = {r["i"]: dict(r["first_logprobs"]) for r in reference if r.get("first_logprobs")}
    kls = [(r["blended"], top_k_kl(ref[r["i"]], dict(r["first_logprobs"])))
           for r in records if r.get("first_logprobs") and r["i"] in ref]
    if not kls:
        return {}
    blended = [k for b, k in kls if b]
    return {"kl_requests": len(kls), "first_token_kl_mean": sum(k for _, k in kls) / len(kls),
            "first_token_kl_p90": percentile([k for _, k in kls], 0.9), "kl_blended_requests": len(blended),
            "first_token_kl_blended_mean": sum(blended) / len(blended) if blended else None}


def instance_summary(records, instances: int) -> dict:
    """Per instance: chunk hit rate and vLLM's cached share; the passages first seen elsewhere (see
    passages_first_seen_elsewhere) and the chunk hit rate of the requests with some, and of the rest."""
    by = [[r for r in records if r.get("instance", 0) == i] for i in range(instances)]
    elsewhere = [r for r in records if r.get("passages_first_seen_elsewhere", 0)]
    rest = [r for r in records if not r.get("passages_first_seen_elsewhere", 0)]
    return {"instances": instances, "chunk_hit_rate_per_instance": [hit_rate(rs) for rs in by],
            "vllm_cached_share_per_instance": [sum(r["cached_tokens"] or 0 for r in rs) /
                                               sum(r["prompt_tokens"] for r in rs) if rs else None for rs in by],
            "passages_first_seen_elsewhere": sum(r["passages_first_seen_elsewhere"] for r in elsewhere),
            "requests_first_seen_elsewhere": len(elsewhere),
            "first_seen_elsewhere_chunk_hit_rate": hit_rate(elsewhere),
            "other_requests_chunk_hit_rate": hit_rate(rest)}


def summarize(records, wall_s: float, high_hit: set[int] | None, instances: int = 1) -> dict:
    ttft = [r["ttft_s"] for r in records]
    high = [r["ttft_s"] for r in records if high_hit is not None and r["i"] in high_hit]
    blocks, tokens = sum(r["chunk_blocks"] for r in records), sum(r["prompt_tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall_s, "requests_per_s": len(records) / wall_s,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "high_hit_requests": len(high), "high_hit_ttft_p50_s": percentile(high, 0.5) if high else None,
            "high_hit_ttft_p90_s": percentile(high, 0.9) if high else None,
            "chunk_hit_rate": sum(r["chunk_hit_blocks"] for r in records) / blocks if blocks else None,
            "blended_share": sum(r["blended"] for r in records) / len(records),
            # mean token F1 of the (max_tokens-long) answers against the gold answers; older runs have none
            "answer_f1": sum(r["f1"] for r in records) / len(records) if all("f1" in r for r in records) else None,
            "vllm_cached_share": sum(r["cached_tokens"] or 0 for r in records) / tokens,
            **instance_summary(records, instances)}


def finish(results: dict) -> None:
    """Summaries of every run (plain's high-hit requests: those of the Blend run at its load) and speed-ups."""
    runs = {(r["server"], r["load"]): r for r in results["runs"]}
    schedule = MountSchedule.parse(results["config"].get("mount") or "")
    for (server, load), run in runs.items():
        blend = runs.get(("blend", load))
        run["summary"].update(summarize(run["records"], run["wall_s"],
                                        high_hit_requests(blend["records"]) if blend else None,
                                        results["config"].get("instances", 1)))
        run["summary"].update(alone_summary(run["records"], run.get("alone")))
        run["summary"].update(alone_summary(run["records"], run.get("alone_same_misses"), "alone_same_misses"))
        if server == "blend" and (plain := runs.get(("plain", load))):
            run["summary"].update(kl_summary(run["records"], plain["records"]))
        if schedule.window:
            run["summary"].update(window_summary(run["records"], schedule.at, schedule.duration))
    results["speedup"] = {load: {"requests_per_s": b["summary"]["requests_per_s"] / p["summary"]["requests_per_s"],
                                 "ttft_p50": p["summary"]["ttft_p50_s"] / b["summary"]["ttft_p50_s"]}
                          for (s, load), p in runs.items() if s == "plain" and (b := runs.get(("blend", load)))}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_table(results: dict) -> None:
    print("\n| server | load | req/s | TTFT p50 / p90 | high-hit TTFT p50 (n) | chunk hits | blended | "
          "fallbacks | written / read MB | store MB | dumped, not in store |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        s, hh = run["summary"], run["summary"]["high_hit_ttft_p50_s"]
        hits = "-" if s["chunk_hit_rate"] is None else f"{s['chunk_hit_rate']:.0%}"
        mb = (f"{s['dump_bytes'] / 1e6:.0f} / {s['load_bytes'] / 1e6:.0f} | {s['store_bytes'] / 1e6:.0f} | "
              f"{s['dumped_not_in_store']}" if run["server"] == "blend" else "- | - | -")
        print(f"| {run['server']} | {run['load']} | {s['requests_per_s']:.3f} | {s['ttft_p50_s']:.2f} / "
              f"{s['ttft_p90_s']:.2f} s | {'-' if hh is None else f'{hh:.2f} s'} ({s['high_hit_requests']}) | {hits} | "
              f"{s['blended_share']:.0%} | {sum(s.get('fallbacks', {}).values())} | {mb} |")
    for load, x in results["speedup"].items():
        runs = {r["server"]: r for r in results["runs"] if r["load"] == load}
        paired = paired_speedup(*({rec["i"]: rec["ttft_s"] for rec in runs[s]["records"]} for s in ("plain", "blend")))
        print(f"blend over plain at {load}: {x['requests_per_s']:.2f}x requests/s, {x['ttft_p50']:.2f}x TTFT p50"
              + (f", {paired[0]:.2f}x TTFT request by request" if paired else ""))
    for run in results["runs"]:
        s = run["summary"]
        if s.get("alone_requests"):
            print(f"{run['server']} {run['load']}: {s['alone_requests']} high-hit requests sent again alone: TTFT p50 "
                  f"{s['alone_ttft_p50_s']:.2f} s alone, {s['alone_stream_ttft_p50_s']:.2f} s in the stream; "
                  f"stream / alone median {s['high_hit_vs_alone']:.2f}x")
    for run in results["runs"]:
        s = run["summary"]
        if s.get("instances", 1) > 1:
            print(f"{run['server']} {run['load']}: chunk hits per instance "
                  f"{' / '.join(_pct(x) for x in s['chunk_hit_rate_per_instance'])}, vLLM cached per instance "
                  f"{' / '.join(_pct(x) for x in s['vllm_cached_share_per_instance'])}; "
                  f"{s['passages_first_seen_elsewhere']} passages first seen on another instance in "
                  f"{s['requests_first_seen_elsewhere']} requests: their chunk hits "
                  f"{_pct(s['first_seen_elsewhere_chunk_hit_rate'])} (other requests "
                  f"{_pct(s['other_requests_chunk_hit_rate'])})")


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in results["runs"]:
        recs = sorted(run["records"], key=lambda r: r["start_s"])
        ax.plot([r["start_s"] for r in recs], [r["ttft_s"] for r in recs], marker=".", linewidth=0.8,
                label=f"{run['server']} {run['load']}")
    ax.set(xlabel="request sent at (s into the run)", ylabel="TTFT (s)", yscale="log")
    ax.set_title(f"RAG stream, {results['dataset']}, ~{results['mean_prompt_tokens']:.0f}-token prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def build_prompts(tokenizer, examples, pool, stream):
    """Per request (token ids, chunk lengths); and each passage of the stream alone (indexing)."""
    from ucm.eval.prompts import build_prompt, chunk_end_token_id

    marker = chunk_end_token_id(tokenizer)
    built = [build_prompt(tokenizer, replace(examples[r.question], passages=tuple(pool[p] for p in r.passages)),
                          marker) for r in stream]
    prompts, index = [(p.token_ids, list(p.chunk_lengths)) for p in built], []
    for p in stream_passages(stream):
        alone = build_prompt(tokenizer, replace(examples[0], passages=(pool[p],)), marker)
        sys_len, n = alone.chunk_lengths
        index.append((alone.token_ids[sys_len:sys_len + n], [n]))
    return prompts, index


def elsewhere_counts(stream, instances: int, index: bool) -> list[int]:
    """passages_first_seen_elsewhere of each request of the stream (after the --index requests)."""
    first = [(p,) for p in stream_passages(stream)] if index else []
    requests = first + [r.passages for r in stream]
    counts = passages_first_seen_elsewhere(requests, routing(len(first), instances) + routing(len(stream), instances))
    return counts[len(first):]


def answer_f1(text: str, answers) -> float:
    """The answer's token F1 against the question's gold answers (its first sentence, as ucm.eval scores)."""
    from ucm.eval.metrics import best_f1, short_answer

    return best_f1(short_answer(text), list(answers))


async def serve_runs(server, urls, prompts, index, stream, args, levels, results, out, store, answers,
                     pids=(), mount=None) -> None:
    import httpx

    routes = routing(len(stream), len(urls))
    elsewhere = elsewhere_counts(stream, len(urls), args.index)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=900)) for url in urls]
        model = (await clients[0].get("/v1/models")).json()["data"][0]["id"]
        await warm_up(clients, model, prompts, args.warmup, server == "blend")
        for level in levels:
            load = f"{'c' if level[0] == 'concurrency' else 'r'}={level[1]:g}"
            salt, blend = f"{TENANT}-{load}", server == "blend"
            run = {"server": server, "load": load, level[0]: level[1], "records": [], "wall_s": 0.0, "summary": {}}
            results["runs"].append(run)
            if args.index:
                t = time.perf_counter()
                await run_stream(clients, model, index, salt, blend, 1, ("concurrency", 2), 0, lambda rec: None)
                run["index_wall_s"] = time.perf_counter() - t
            before = sum_counters(urls)

            def on_record(rec):
                i, req = rec["i"], stream[rec["i"]]
                run["records"].append({**rec, "question": req.question, "noise": len(req.noise),
                                       "f1": answer_f1(rec["text"], answers[rec["i"]]),
                                       "instance": routes[i], "passages_first_seen_elsewhere": elsewhere[i]})
                out.write_text(json.dumps(results, indent=1))

            run["rss_mb"], run["mount_events"] = [], []
            sampler = asyncio.create_task(sample_rss(list(pids), run["rss_mb"]))
            timers = MountSchedule.parse(args.mount).start(mount, run["mount_events"]) if mount else []
            mount_cpu = mount.cpu_seconds() if mount else None
            try:
                run["wall_s"] = await run_stream(clients, model, prompts, salt, blend, args.max_tokens, level,
                                                 args.seed, on_record, args.logprobs)
            finally:
                sampler.cancel()
                for timer in timers:
                    timer.cancel()
                if mount:
                    mount.set()
            run["summary"] = store_summary(before, sum_counters(urls), store)
            mount_cpu_end = mount.cpu_seconds() if mount else None
            if mount_cpu is not None and mount_cpu_end is not None:
                run["summary"]["mount_server_cpu_s"] = mount_cpu_end - mount_cpu
            if blend and args.alone:  # after the run's counters: these requests are not part of it
                run["alone"], run["alone_same_misses"] = [], []
                records = {r["i"]: r for r in run["records"]}
                for i in alone_picks(run["records"], args.alone):
                    # First with the chunks it missed in the stream still missing, then as it was.
                    same = with_same_misses(prompts[i], records[i]["chunk_hits"], args.seed + i)
                    for key, prompt in (("alone_same_misses", same), ("alone", prompts[i])):
                        rec = await send(clients[routes[i]], model, prompt, salt, blend, args.max_tokens)
                        run[key].append({"i": i, **rec})
                        out.write_text(json.dumps(results, indent=1))
            finish(results)
            s = run["summary"]
            print(f"{server} {load}: {s['requests_per_s']:.3f} req/s, TTFT p50 {s['ttft_p50_s']:.2f} s, "
                  f"blended {s['blended_share']:.0%}", flush=True)
            if "window_requests_per_s" in s:
                print(f"{server} {load}: in the mount's fault window {s['window_requests_per_s']:.3f} req/s, the "
                      f"minute after {s['after_window_requests_per_s']:.3f} req/s, first blend after the release "
                      f"{s['first_blend_after_release_s']} s, resident memory (s, MB) {run['rss_mb']}", flush=True)
            out.write_text(json.dumps(results, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from ucm.models import model_path

    # a directory, or a name from ucm.models' catalog (prepared once, as blend_bench.py takes it)
    model = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # fresh: questions sharing a passage with an earlier one are skipped (MuSiQue's often do), so load spares
    needed = 3 * fresh_questions_needed(args.num_requests, args.noise, args.passages) if args.fresh else args.questions
    dataset, examples = load_examples(args.generated, needed, passages=args.passages, passage_words=args.passage_words)
    examples = [replace(ex, passages=ex.passages[:args.passages]) for ex in examples]
    pool, questions = passage_pool(examples)
    stream = make_stream(questions, args.num_requests, args.zipf, args.noise, args.seed, args.fresh)
    prompts, index = build_prompts(tokenizer, examples, pool, stream)
    levels = [("rate", r) for r in args.rates] if args.rates else [("concurrency", c) for c in args.concurrency]
    results = {"dataset": dataset, "config": {k: v for k, v in vars(args).items() if k != "model"},
               "mean_prompt_tokens": sum(len(ids) for ids, _ in prompts) / len(prompts), "ratio": args.ratio,
               "dtype": args.dtype, "model": Path(model).name,
               "unique_passages": len(index), "runs": [], "speedup": {}, "host": host_record()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    envs = core_binding(args.instances, os.sched_getaffinity(0))
    from ucm.eval.prompts import chunk_end_token_id

    marker = chunk_end_token_id(tokenizer)  # the model's <|im_end|>: each chat message a chunk
    for server in args.servers:
        ports: list[int] = []
        while len(ports) < args.instances:
            if (port := free_port()) not in ports:
                ports.append(port)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        with contextlib.ExitStack() as stack:
            store, mount = stack.enter_context(mounted_store(args.mount)) if server == "blend" else (None, None)
            store_extra = {**json.loads(args.store_config),
                           **({"capacity_gb": args.capacity_gb} if args.capacity_gb else {})}
            ktc = blend_config(store, args.ratio, ["ucm_chunk_lengths"], store_extra, json.loads(args.blend_config),
                               marker) if store else None
            if ktc is not None:
                ktc["kv_connector_extra_config"].update(json.loads(args.connector_config))
            procs = []
            try:
                for i, port in enumerate(ports):  # one log per instance: .blend.log, or .blend.0.log, ...
                    log = stack.enter_context(open(out.with_suffix(
                        f".{server}.log" if args.instances == 1 else f".{server}.{i}.log"), "w"))
                    procs.append(start_server(model, port, SERVE_FLAGS + args.serve_args.split(), log, ktc, envs[i],
                                              dtype=args.dtype))
                for url, proc in zip(urls, procs):
                    wait_healthy(url, proc)
                asyncio.run(serve_runs(server, urls, prompts, index, stream, args, levels, results, out, store,
                                       [examples[r.question].answers for r in stream], [p.pid for p in procs], mount))
            finally:
                for proc in procs:
                    with contextlib.suppress(ProcessLookupError):  # one already gone: stop the others
                        stop_server(proc)
    print_table(results)
    if not args.no_plot:
        plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
