"""What a stream's slow first tokens waited behind: each request's TTFT beside the full prefills
(requests that did not blend) still computing when it arrived, from `rag_traffic.py` result files.

    python benchmarks/ttft_queue.py benchmarks/results/rag_traffic_zipf48_c4_s23_bf16.json

A closed-loop client sends its next request when one ends. Under plain vLLM every request costs
about the same, so arrivals stay staggered and a request finds about one prefill in flight. With
Blend, requests that blend end early and the clients' next requests can arrive together: a
request that misses may then queue behind two full prefills. The printout shows, per run, the
slowest requests and the TTFT of the requests that did not blend by how many full prefills they
found in flight, and how many blend requests that came after them had their first token first
(moved ahead, or run beside their prefill); the first `--skip` requests, sent at once, left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    ttft_s: float
    blended: bool
    prefills_ahead: int  # requests that did not blend, arrived before it, first token not yet out
    blends_ahead: int
    overtaken_by: int  # blend requests that arrived after it and whose first token came before its own


def arrivals(records: list[dict], skip: int) -> list[Arrival]:
    out = []
    for r in records[skip:]:
        start = r["start_s"]
        ahead = [o for o in records if o["start_s"] < start < o["start_s"] + o["ttft_s"]]
        end = start + r["ttft_s"]
        overtook = [o for o in records if o["blended"] and start < o["start_s"] and o["start_s"] + o["ttft_s"] < end]
        out.append(Arrival(r["ttft_s"], bool(r["blended"]), sum(not o["blended"] for o in ahead),
                           sum(bool(o["blended"]) for o in ahead), len(overtook)))
    return out


def report(path: str, skip: int, top: int) -> None:
    data = json.load(open(path))
    for run in data["runs"]:
        rows = arrivals(run["records"], skip)
        print(f"{path} [{run['server']} {run['load']}]: TTFT p90 {run['summary']['ttft_p90_s']:.1f} s")
        slow = sorted(rows, key=lambda a: -a.ttft_s)[:top]
        print("  slowest: " + ", ".join(f"{a.ttft_s:.1f} s ({'blend' if a.blended else 'full'}, "
                                        f"{a.prefills_ahead} full + {a.blends_ahead} blend ahead, "
                                        f"{a.overtaken_by} blend after it done first)" for a in slow))
        by_ahead = defaultdict(list)
        for a in rows:
            if not a.blended:
                by_ahead[a.prefills_ahead].append(a)
        for n, group in sorted(by_ahead.items()):
            ttfts = [a.ttft_s for a in group]
            print(f"  not blended, {n} full prefill(s) ahead: {len(ttfts)} requests, TTFT mean "
                  f"{statistics.mean(ttfts):.1f} s, max {max(ttfts):.1f} s, overtaken by "
                  f"{statistics.mean(a.overtaken_by for a in group):.1f} blend requests on average")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="rag_traffic.py JSON files")
    p.add_argument("--skip", type=int, default=4, help="first requests left out (sent at once; default 4)")
    p.add_argument("--top", type=int, default=6, help="slowest requests listed (default 6)")
    args = p.parse_args()
    for path in args.results:
        report(path, args.skip, args.top)


if __name__ == "__main__":
    main()
