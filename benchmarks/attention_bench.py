"""Blend's attention of scattered rows over one long sequence: the torch path against each
variant of the native kernel this CPU runs (csrc/paged_attention.cpp).

The geometry is SmolLM2-135M's by default (9 query heads, 3 KV heads, head size 64; the 1.5B's:
``--kv-heads 2 --group 6 --head-size 128``) over a ~6k-token prompt in vLLM's CPU pages (float32
"vec" or bfloat16 "vec16"); the rows are those one Blend layer sends to this path on a RAG
prompt: the recomputed share of the loaded tokens, scattered (runs of 16 rows or more, such as
misses and the question, go to vLLM's own kernel). Both paths read the pages: the torch one
gathers K/V out of them first, as sparse_attention.py does.

    python benchmarks/attention_bench.py --out /tmp/attention_bench.json
    python benchmarks/attention_bench.py --dtype bfloat16    # bfloat16 pages: every variant, the dot one too
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

from ucm.argparse_help import HelpFormatter
from ucm.integration.vllm.kv_layout import CpuKVLayout
from ucm.sparse.blend.tiled_attention import NATIVE_ISAS, TilePlan, paged_causal_attention, tiled_causal_attention

DEFAULT_OUT = Path(tempfile.gettempdir()) / "attention_bench.json"  # results to keep: --out benchmarks/results/...


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--keys", type=int, default=6144, help="prompt length")
    p.add_argument("--recomputed", type=float, default=0.15, help="share of the loaded tokens recomputed")
    p.add_argument("--misses", type=float, default=0.25, help="share of the prompt without loaded KV (runs)")
    p.add_argument("--page-size", type=int, default=128, help="vLLM's CPU block size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="pages' and queries' dtype")
    p.add_argument("--layout", choices=("vec", "amx"), default="vec",
                   help="bfloat16 pages' layout: vLLM's vec16 or, as vLLM packs them on CPUs with AMX, its VNNI tiles")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5, help="timed calls per path (best is reported)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON")
    return p.parse_args(argv)


def rows(keys: int, recomputed: float, misses: float, gen: torch.Generator) -> torch.Tensor:
    """Sorted positions of the recomputed share of the loaded tokens (those outside 8 runs of
    misses and the 64-token question)."""
    run = int(keys * misses / 8)
    missed = torch.zeros(keys, dtype=torch.bool)
    for s in torch.randperm(keys - run - 64, generator=gen)[:8].tolist():
        missed[s:s + run] = True
    missed[-64:] = True
    loaded = torch.nonzero(~missed).flatten()
    return torch.sort(loaded[torch.randperm(loaded.numel(), generator=gen)[:int(recomputed * loaded.numel())]]).values


def main(argv=None) -> dict:
    args = parse_args(argv)
    hk, group, d, ps = args.kv_heads, args.group, args.head_size, args.page_size
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    num_pages = math.ceil(args.keys / ps)
    cache = torch.randn(num_pages + 4, hk, ps, 2 * d, generator=gen).to(dtype)  # vLLM's CPU cache pages
    if args.layout == "amx" and dtype != torch.bfloat16:
        raise SystemExit("--layout amx needs --dtype bfloat16")
    layout = CpuKVLayout(ps, hk, d, isa="vec" if dtype == torch.float32 else "vec16" if args.layout == "vec" else "amx")
    table = torch.randperm(num_pages + 4, generator=gen)[:num_pages]
    pos = rows(args.keys, args.recomputed, args.misses, gen)
    q = torch.randn(pos.numel(), hk * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)

    def torch_path():  # as sparse_attention.py runs it: gather the pages, then the tiles
        k_t, v = layout.gather_pages_head_major(cache, table)
        return tiled_causal_attention(q, k_t, v, TilePlan.build(pos, group), scale)

    paths = {"torch": torch_path}
    for isa in NATIVE_ISAS:
        paths[isa] = lambda isa=isa: paged_causal_attention(q, pos, layout.pages(cache), table, scale,
                                                                         page_format=layout.page_format, isa=isa)
    reference = torch_path()
    result = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "keys": args.keys, "rows": pos.numel(), "page_size": ps, "dtype": args.dtype,
              "layout": layout.page_format,
              "geometry": {"kv_heads": hk, "group": group, "head_size": d}, "seconds": {}, "max_abs_diff": {}}
    for name, fn in paths.items():
        fn()  # warm-up
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        result["seconds"][name] = min(times)
        result["max_abs_diff"][name] = float((out.float() - reference.float()).abs().max())
        print(f"{name:>7}: {min(times) * 1e3:8.1f} ms per layer ({pos.numel()} rows over {args.keys} keys), "
              f"{result['seconds']['torch'] / min(times):.2f}x the torch path")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
