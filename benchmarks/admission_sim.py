"""Admission rules replayed on many request streams, without a server: which chunk blocks each
rule would have loaded, stored and only sighted, over many seeds of rag_traffic.py's streams.

A served run is one seed: whether the fourth request's passages come back decides what a rule
with one request less of evidence loses there. This replays rag_traffic.py's streams (the same
`make_stream`, the same MuSiQue questions) through the connector's own rule (`RecentHits`,
`admits_first_sighting`, `reused_unstored`'s accounting) under a closed loop at concurrency c:
request j is planned after every earlier request's first step (their sightings and lookups
count), and finds the KV of request i only when i's prefill ended before j was planned, taken as
i <= j - lag, for lag c (the requests in flight beside it have not finished theirs) and c - 1 (one
has: a served run's hits lie between the two). A
passage is a chunk of ceil(its tokens / block size) blocks (a chunk's last, partial block counts); each prompt adds one system block that
every request after the first finds (the first one's first step stores it). The suffix (question) is left out.

    python benchmarks/admission_sim.py --seeds 100 --out benchmarks/results/admission_sim.json

Per rule (evidence lookups, which lookups count; the hit-share threshold is the connector's) and
stream: chunk blocks hit (mean over seeds, and seed 0), KV blocks written, sightings; for the fresh
stream KV written as a share of what the stream computes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from _serving import load_examples
from rag_traffic import fresh_questions_needed, make_stream, passage_pool
from ucm.argparse_help import HelpFormatter
from ucm.sparse.blend import admission
from ucm.sparse.blend.admission import ADAPTIVE, RecentHits, admits_first_sighting

BLOCK_SIZE = 128  # vLLM's block size on CPU
WINDOW = admission.RECENT_REQUESTS


def replay(stream, blocks: dict[int, int], evidence: int, lag: int, cold: int, warm_only: bool = True,
           warmup: int = 0) -> dict:
    """One stream through the adaptive rule: blocks looked up, found (KV loaded), written, sighted.
    The first `cold` requests are planned before any request finished (a closed loop's first c; a
    warm-up sent alone: itself only); `warm_only`: their lookups count only if they found the
    threshold's share (the committed rule), else always (the rule before). The first `warmup` requests are
    counted in the rule's window but not in the totals."""
    recent = RecentHits(WINDOW, evidence)
    stored_by: dict[int, int] = {}  # passage -> request whose prefill stored its KV
    sighted: set[int] = set()
    system_stored_by: int | None = None
    out = {"looked_up": 0, "found": 0, "written": 0, "written_all": 0, "computed": 0, "sightings": 0}
    for j, req in enumerate(stream):
        available = lambda i: i is not None and i <= j - lag  # noqa: E731
        found = sum(blocks[p] for p in req.passages if available(stored_by.get(p)))
        found += 1 if system_stored_by is not None else 0  # stored by the first request's first step
        looked_up = sum(blocks[p] for p in req.passages) + 1
        first = admits_first_sighting(ADAPTIVE, recent)
        reused = 0
        written = 0
        sightings = 0
        for p in req.passages:
            if available(stored_by.get(p)):
                continue
            if first or p in sighted:
                reused += 0 if first else blocks[p]
                written += blocks[p]
                stored_by.setdefault(p, j)
            else:
                sighted.add(p)
                sightings += 1
        if system_stored_by is None:
            system_stored_by = j
            written += 1
        recent.add(found + reused, looked_up, warm=j >= cold or not warm_only)
        out["written_all"] += written
        if j >= warmup:
            out["looked_up"] += looked_up
            out["found"] += found
            out["written"] += written
            out["computed"] += looked_up - found
            out["sightings"] += sightings
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--seeds", type=int, default=100, help="Zipf streams replayed (seeds 0..N-1)")
    p.add_argument("--num-requests", type=int, default=48, help="requests per Zipf stream")
    p.add_argument("--fresh-requests", type=int, default=36, help="timed requests of the fresh stream (one warm-up more)")
    p.add_argument("--concurrency", default="2,4", help="closed-loop concurrencies")
    p.add_argument("--rules", default="4:any,3:any,2:warm,3:warm",
                   help="evidence lookups:which lookups count (any, or warm: those made after a request finished, "
                        "and cold ones that found the threshold's share), comma separated")
    p.add_argument("--out", type=Path, default=None, help="JSON of the results")
    args = p.parse_args(argv)
    rules = [(int(e), w == "warm") for e, w in (r.split(":") for r in args.rules.split(","))]
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    from transformers import AutoTokenizer

    from ucm.models.preparation import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path(None))
    def stream_blocks(limit: int):
        _, examples = load_examples(False, limit)
        pool, questions = passage_pool([replace(ex, passages=ex.passages[:10]) for ex in examples])
        counts = {i: -(-len(tokenizer.encode(text, add_special_tokens=False)) // BLOCK_SIZE) for i, text in enumerate(pool)}
        return questions, counts

    zipf_questions, zipf_blocks = stream_blocks(50)
    fresh_questions, fresh_blocks = stream_blocks(3 * fresh_questions_needed(args.fresh_requests + 1, 2, 10))
    fresh = make_stream(fresh_questions, args.fresh_requests + 1, fresh=True)
    dataset = "MuSiQue"

    results = {"dataset": dataset, "seeds": args.seeds, "num_requests": args.num_requests, "rules": []}
    print(f"{'rule':>14} {'c':>2} {'lag':>3} {'Zipf hit (mean, min..max)':>28} {'seed 0':>7} {'written':>8} "
          f"{'fresh: KV written':>18}")
    for evidence, warm_only in rules:
        for c in concurrencies:
            for lag in sorted({c, max(1, c - 1)}, reverse=True):
                runs = [replay(make_stream(zipf_questions, args.num_requests, seed=s), zipf_blocks, evidence, lag, c,
                               warm_only) for s in range(args.seeds)]
                hits = [r["found"] / r["looked_up"] for r in runs]
                f = replay(fresh, fresh_blocks, evidence, lag, 1, warm_only, warmup=1)
                fresh_share = f["written_all"] / f["computed"]  # the warm-up's KV too, of what the timed requests compute
                row = {"evidence": evidence, "threshold": admission.ADMIT_ALL_HIT_SHARE,
                       "lookups": "warm" if warm_only else "any",
                       "concurrency": c, "lag": lag,
                       "zipf_hit_mean": statistics.mean(hits), "zipf_hit_min": min(hits), "zipf_hit_max": max(hits),
                       "zipf_hit_seed0": hits[0], "zipf_written_mean": statistics.mean(r["written"] for r in runs),
                       "zipf_sightings_mean": statistics.mean(r["sightings"] for r in runs),
                       "fresh_written_share": fresh_share, "zipf_hits": hits}
                results["rules"].append(row)
                print(f"{evidence:>2} {'warm' if warm_only else 'any':<4} / {admission.ADMIT_ALL_HIT_SHARE:<5} {c:>2} {lag:>3} {row['zipf_hit_mean']:>10.1%} "
                      f"({row['zipf_hit_min']:.1%}..{row['zipf_hit_max']:.1%}) {hits[0]:>7.1%} "
                      f"{row['zipf_written_mean']:>8.0f} {fresh_share:>18.1%}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
