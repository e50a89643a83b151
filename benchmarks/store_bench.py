"""Throughput of UcmNfsStore against plain OS reads of the same files.

The block is one realistic KV block of the embedded model (SmolLM2-135M: 30 layers, K and V,
3 KV heads, head_dim 64, 128 tokens, float32 = 5,898,240 bytes). Loads run with a warm page
cache, so `load / raw` compares the store's verified read path with the cheapest possible
read of the same bytes.

    python benchmarks/store_bench.py [--blocks 200] [--dir /mnt/nfs/bench] [--threads 4]

With `--mount SPEC` (benchmarks/_mount_schedule.py: `latency_ms=5`, `bandwidth_mb_s=200`) the store
sits behind the FUSE test mount (tests/fault_mount.py, root only), where an NFS server's round trips
are what a load waits for: the blocks are dumped, then loaded once with the mount's cached names
expired, as a stream's loads find them.

    python benchmarks/store_bench.py --mount latency_ms=5 --blocks 32 --threads 2 [--direct] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from ucm.store import UcmNfsStore
from ucm.argparse_help import HelpFormatter

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, DTYPE_BYTES = 30, 3, 64, 128, 4
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * BLOCK_TOKENS * DTYPE_BYTES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--blocks", type=int, default=200, help="blocks to dump and load (200: ~1.2 GB)")
    ap.add_argument("--dir", default=None, help="directory to use (none: a fresh temp dir, removed after)")
    ap.add_argument("--threads", type=int, default=4, help="io_threads of the store")
    ap.add_argument("--batch", type=int, default=16, help="blocks per load/dump call")
    ap.add_argument("--lookup-keys", type=int, default=10_000)
    ap.add_argument("--direct", action="store_true", help="io_direct=True")
    ap.add_argument("--mount", default=None, metavar="SPEC",
                    help="the store behind the FUSE test mount with these steady faults, e.g. latency_ms=5")
    ap.add_argument("--bf16", action="store_true", help="blocks of 2-byte KV (half the bytes)")
    args = ap.parse_args()
    block_bytes = BLOCK_BYTES // 2 if args.bf16 else BLOCK_BYTES
    if args.mount:
        print(json.dumps(run_mounted(args, block_bytes)))
        return

    root = args.dir or tempfile.mkdtemp(prefix="ucm-store-bench-")
    bench_dir = os.path.join(root, f"bench-{os.getpid()}")
    store = UcmNfsStore({"storage_backends": bench_dir, "io_threads": args.threads, "io_direct": args.direct})
    store.wait_open_scan()
    try:
        rows = run(store, args)
    finally:
        store.close()
        shutil.rmtree(bench_dir, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows, args)


def blocks(rng: np.random.Generator, n: int, nbytes: int) -> tuple[list[bytes], list[np.ndarray]]:
    """`n` random keys and blocks of distinct contents (filling GBs with random numbers would
    dominate the run)."""
    keys = [rng.bytes(16) for _ in range(n)]
    base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return keys, [np.roll(base, i * 4099) for i in range(n)]


def run(store: UcmNfsStore, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    n = args.blocks
    rng = np.random.default_rng(0)
    keys, sources = blocks(rng, n, BLOCK_BYTES)
    dests = [np.empty(BLOCK_BYTES, dtype=np.uint8) for _ in range(n)]
    batches = [range(i, min(n, i + args.batch)) for i in range(0, n, args.batch)]
    total = n * BLOCK_BYTES

    t = time.perf_counter()
    tasks = [store.dump([keys[i] for i in b], [sources[i] for i in b], [BLOCK_TOKENS] * len(b)) for b in batches]
    assert all(all(store.wait(task)) for task in tasks), "dump failed"
    dump_s = time.perf_counter() - t

    def load_all() -> float:
        t0 = time.perf_counter()
        tasks = [store.load([keys[i] for i in b], [dests[i] for i in b]) for b in batches]
        assert all(all(store.wait(task)) for task in tasks), "load failed"
        return time.perf_counter() - t0

    load_all()  # warm the page cache and the destination pages
    load_s = min(load_all() for _ in range(3))
    assert all(np.array_equal(s, d) for s, d in zip(sources[:3], dests[:3]))

    # Raw baselines read the whole file (header region + payload) with no verification:
    #  * into the same destination arrays the store loads into (like for like: both write
    #    1.2 GB to DRAM) -- the ratio below uses this one;
    #  * into one reused buffer that stays in the CPU cache (upper bound; no DRAM writes).
    paths = [store.block_path(k) for k in keys]
    file_bytes = os.path.getsize(paths[0])
    raw_dests = [np.empty(file_bytes, dtype=np.uint8) for _ in range(n)]
    reused = bytearray(file_bytes)

    def raw_read_all(targets: list) -> float:
        t0 = time.perf_counter()
        for p, target in zip(paths, targets):
            with open(p, "rb", buffering=0) as f:
                f.readinto(target)
        return time.perf_counter() - t0

    raw_read_all(raw_dests)
    raw_s = min(raw_read_all(raw_dests) for _ in range(3))
    reused_s = min(raw_read_all([reused] * n) for _ in range(3))
    raw_bytes = n * file_bytes
    del raw_dests

    lookup_keys = keys[: min(n, args.lookup_keys // 10)]
    lookup_keys += [rng.bytes(16) for _ in range(args.lookup_keys - len(lookup_keys))]
    store.lookup(lookup_keys)
    t = time.perf_counter()
    found = store.lookup(lookup_keys)
    lookup_s = time.perf_counter() - t
    assert sum(found) == min(n, args.lookup_keys // 10)

    where = "O_DIRECT, no page cache" if args.direct else "warm page cache"
    gbps = lambda nbytes, s: f"{nbytes / s / 1e9:.2f} GB/s"  # noqa: E731
    load_rate, raw_rate = total / load_s, raw_bytes / raw_s
    return [
        (f"dump (write + rename, {where})", f"{dump_s:.3f} s", gbps(total, dump_s)),
        (f"load (read + XXH64 verify, {where})", f"{load_s:.3f} s", gbps(total, load_s)),
        ("raw readinto, same destinations (warm)", f"{raw_s:.3f} s", gbps(raw_bytes, raw_s)),
        ("load / raw", "", f"{load_rate / raw_rate:.2f}x (target >= 0.8x)"),
        ("raw readinto, one reused cached buffer", f"{reused_s:.3f} s", gbps(raw_bytes, reused_s)),
        ("load / raw-reused (upper bound)", "", f"{load_rate / (raw_bytes / reused_s):.2f}x"),
        (
            f"lookup {len(lookup_keys)} keys ({sum(found)} hits)",
            f"{lookup_s * 1e3:.1f} ms",
            "target < 50 ms",
        ),
    ]


def run_mounted(args: argparse.Namespace, block_bytes: int) -> dict:
    """Dump, then one load with the mount's name and attribute caches expired (their 1 s timeout)."""
    from _mount_schedule import MountSchedule, mounted_store

    steady = MountSchedule.parse(args.mount).steady
    with mounted_store(args.mount) as (root, mount):
        store = UcmNfsStore({"storage_backends": os.path.join(root, "store"), "io_threads": args.threads,
                             "io_direct": args.direct})
        store.wait_open_scan()
        try:
            keys, sources = blocks(np.random.default_rng(0), args.blocks, block_bytes)
            # Staging rows are rarely 4 KiB aligned: neither are these destinations.
            raw = np.empty(args.blocks * block_bytes + 64, dtype=np.uint8)
            dests = [raw[64 + i * block_bytes:64 + (i + 1) * block_bytes] for i in range(args.blocks)]
            mount.set(**steady)
            t = time.perf_counter()
            assert all(store.wait(store.dump(keys, sources, [BLOCK_TOKENS] * args.blocks))), "dump failed"
            dump_s = time.perf_counter() - t
            time.sleep(1.5)
            t, cpu = time.perf_counter(), mount.cpu_seconds()
            assert all(store.wait(store.load(keys, dests))), "load failed"
            load_s = time.perf_counter() - t
            server_cpu = mount.cpu_seconds()
            server_cpu = None if cpu is None or server_cpu is None else round(server_cpu - cpu, 3)
            assert all(np.array_equal(s, d) for s, d in zip(sources, dests))
        finally:
            mount.set()
            store.close()
    per_block = lambda s: round(1000 * s * args.threads / args.blocks, 1)  # noqa: E731
    return {"mount": args.mount, "blocks": args.blocks, "block_bytes": block_bytes, "io_threads": args.threads,
            "io_direct": args.direct, "dump_s": round(dump_s, 3), "load_s": round(load_s, 3),
            "load_server_cpu_s": server_cpu,  # the mount's own (Python) server: CPU an NFS client would not spend
            "dump_ms_per_block_per_thread": per_block(dump_s), "load_ms_per_block_per_thread": per_block(load_s)}


def print_table(rows: list[tuple[str, str, str]], args: argparse.Namespace) -> None:
    print(
        f"UcmNfsStore: {args.blocks} blocks x {BLOCK_BYTES:,} B = {args.blocks * BLOCK_BYTES / 1e9:.2f} GB, "
        f"io_threads={args.threads}, batch={args.batch}, io_direct={args.direct}, cpus={os.cpu_count()}"
    )
    w = max(len(r[0]) for r in rows)
    print(f"{'operation':<{w}}  {'time':>10}  result")
    print("-" * (w + 40))
    for name, t, result in rows:
        print(f"{name:<{w}}  {t:>10}  {result}")


if __name__ == "__main__":
    main()
