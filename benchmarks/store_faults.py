"""Fault injection against UcmNfsStore: real files, real processes. Prints figures, writes JSON.

    python benchmarks/store_faults.py                 # the long run (about 3 minutes)
    python benchmarks/store_faults.py --quick         # what CI runs (tests/unit/store/test_store_faults.py)

Scenarios (each on its own fresh directory):
  concurrency  N processes for S seconds on K shared keys: lookups, loads verified byte for byte,
               dumps of what is missing. Figure: wrong bytes served (target 0).
  sigkill      writers SIGKILLed mid-dump, again and again; then every visible block is loaded.
               Figure: torn blocks visible (target 0).
  corruption   payload flips, header flips (token count, key), truncations, zero fills and
               same-size swaps of stored blocks. Figures: detected, served (targets all, 0).
  capacity     4 processes write far more than capacity_gb. Figures: peak and final usage in
               blocks over the limit (targets <= 2 per process, 0).
  hot_blocks   blocks one process keeps reading while another evicts. Figure: survivors (all).
  lost_root    the store directory is deleted under an open store. Figure: dumps refused and the
               tree not recreated.
  fifo_timeout a FIFO at a block name, and a load that cannot finish within load_timeout_s.
               Figures: seconds until the loads return (bounded), loads counted as timeouts.
  ledger_lock  another process holds the capacity ledger's lock (a writer stuck in a hung
               mount). Figures: seconds until a dump returns (about lookup_timeout_s, then at
               once), blocks written meanwhile (0), reservations left once it lets go (0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from ucm.store import UcmNfsStore
from ucm.argparse_help import HelpFormatter
from ucm.store.block_format import HEADER_REGION, PREFIX, file_size



def key_of(i: int) -> bytes:
    return xxhash.xxh128(f"fault-{i}".encode()).digest()


def block_for(key: bytes, size: int) -> np.ndarray:
    """Bytes derived from the key alone: any process can verify what it loaded."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def blocks_on_disk(root: str) -> list[Path]:
    return [p for p in Path(root).rglob("*.kvb") if p.is_file()]


def usage(root: str) -> int:
    total = 0
    for p in blocks_on_disk(root):
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


# ---- concurrency ------------------------------------------------------------------------

def _mixed_worker(root: str, keys: list[bytes], size: int, seconds: float, seed: int, out) -> None:
    rng = random.Random(seed)
    store = UcmNfsStore({"storage_backends": root, "io_threads": 2})
    loads = wrong = dumps = 0
    dest = np.zeros(size, np.uint8)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            key = rng.choice(keys)
            if store.lookup([key])[0]:
                if store.wait(store.load([key], [dest])) == [True]:
                    loads += 1
                    wrong += int(not np.array_equal(dest, block_for(key, size)))
            else:
                store.wait(store.dump([key], [block_for(key, size)], [1]))
                dumps += 1
    finally:
        store.close()
    out.put((loads, wrong, dumps))


def concurrency(root: str, procs: int, seconds: float, num_keys: int = 64, size: int = 256 << 10) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    keys = [key_of(i) for i in range(num_keys)]
    workers = [ctx.Process(target=_mixed_worker, args=(root, keys, size, seconds, i, out)) for i in range(procs)]
    for p in workers:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in workers]
    for p in workers:
        p.join(30)
    return {"processes": procs, "seconds": seconds, "keys": num_keys, "verified_loads": sum(r[0] for r in results),
            "wrong_reads": sum(r[1] for r in results), "dumps": sum(r[2] for r in results)}


# ---- SIGKILL mid-dump -------------------------------------------------------------------

def _endless_writer(root: str, first: int, size: int) -> None:
    store = UcmNfsStore({"storage_backends": root, "io_threads": 4})
    i = first
    while True:
        keys = [key_of(i + j) for j in range(4)]
        store.wait(store.dump(keys, [block_for(k, size) for k in keys], [1] * 4))
        i += 4


def sigkill(root: str, kills: int, size: int = 1 << 20) -> dict:
    ctx = mp.get_context("spawn")
    for n in range(kills):
        p = ctx.Process(target=_endless_writer, args=(root, 1_000_000 * (n + 1), size))
        p.start()
        time.sleep(random.uniform(0.8, 1.6))  # start-up, then somewhere inside a dump
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    store = UcmNfsStore({"storage_backends": root})
    visible = blocks_on_disk(root)
    keys = [bytes.fromhex(p.name.removesuffix(".kvb")) for p in visible]
    dest = np.zeros(size, np.uint8)
    torn = 0
    for key in keys:
        ok = store.wait(store.load([key], [dest])) == [True]
        torn += int(not ok or not np.array_equal(dest, block_for(key, size)))
    store.close()
    temps = sum(1 for p in Path(root).rglob("*.tmp"))
    return {"kills": kills, "visible_blocks": len(keys), "torn_blocks": torn, "abandoned_temp_files": temps}


# ---- corruption -------------------------------------------------------------------------

def _rewrite_header(path: Path, **changes) -> None:
    """Changes header fields and keeps the rest, as a bit flip in a field would."""
    raw = bytearray(path.read_bytes())
    _, length = PREFIX.unpack_from(raw)
    fields = msgpack.unpackb(bytes(raw[PREFIX.size:PREFIX.size + length]), raw=False)
    fields.update(changes)
    packed = msgpack.packb(fields)
    region = (PREFIX.pack(raw[:8], len(packed)) + packed).ljust(HEADER_REGION, b"\0")
    path.write_bytes(region + bytes(raw[HEADER_REGION:]))


def corruption(root: str, per_kind: int, size: int = 64 << 10) -> dict:
    kinds = ["payload_flip", "header_flip", "token_count", "key", "truncate", "zero_fill", "swap"]
    store = UcmNfsStore({"storage_backends": root})
    keys = [key_of(50_000 + i) for i in range(per_kind * len(kinds) + per_kind)]  # swaps take a partner
    assert all(store.wait(store.dump(keys, [block_for(k, size) for k in keys], [7] * len(keys))))
    rng = random.Random(0)
    victims: list[tuple[str, bytes]] = []
    it = iter(keys)
    for kind in kinds:
        for _ in range(per_kind):
            key = next(it)
            path = Path(store.block_path(key))
            raw = bytearray(path.read_bytes())
            if kind == "payload_flip":
                raw[HEADER_REGION + rng.randrange(size)] ^= 1 << rng.randrange(8)
                path.write_bytes(raw)
            elif kind == "header_flip":  # a bit inside the msgpack header
                _, length = PREFIX.unpack_from(raw)
                raw[PREFIX.size + rng.randrange(length)] ^= 1 << rng.randrange(8)
                path.write_bytes(raw)
            elif kind == "token_count":
                _rewrite_header(path, token_count=8)
            elif kind == "key":
                _rewrite_header(path, key=key[:-1] + bytes([key[-1] ^ 1]))
            elif kind == "truncate":
                path.write_bytes(raw[:HEADER_REGION + rng.randrange(size)])
            elif kind == "zero_fill":
                start = HEADER_REGION + rng.randrange(size - 4096)
                raw[start:start + 4096] = bytes(4096)
                path.write_bytes(raw)
            else:  # same-size swap: another key's valid block at this name
                partner = next(it)
                shutil.copyfile(store.block_path(partner), path)
            victims.append((kind, key))
    store.close()
    reader = UcmNfsStore({"storage_backends": root})
    dest = np.zeros(size, np.uint8)
    detected: dict[str, int] = {k: 0 for k in kinds}
    served = 0
    meta_wrong = 0
    for kind, key in victims:
        meta = reader.read_meta([key])[0]
        meta_wrong += int(meta is not None and meta.token_count != 7)
        ok = reader.wait(reader.load([key], [dest])) == [True]
        if ok:
            served += int(not np.array_equal(dest, block_for(key, size)))
        else:
            detected[kind] += 1
    reader.close()
    return {"corrupted": len(victims), "detected": sum(detected.values()), "served_wrong": served,
            "wrong_token_counts_reported": meta_wrong, "detected_by_kind": detected}


# ---- capacity and hot blocks ------------------------------------------------------------

def _capacity_writer(root: str, w: int, count: int, size: int, capacity_gb: float, start) -> None:
    store = UcmNfsStore({"storage_backends": root, "capacity_gb": capacity_gb, "io_threads": 1, "usage_rescan_s": 0})
    store.wait_open_scan()
    start.wait()
    for i in range(count):
        k = key_of(10_000_000 * (w + 1) + i)
        store.wait(store.dump([k], [block_for(k, size)], [1]))
    store.close()


def capacity(root: str, writers: int, per_writer: int, capacity_blocks: int, size: int = 60 << 10) -> dict:
    UcmNfsStore({"storage_backends": root}).close()
    block = file_size(size)
    cap_gb = capacity_blocks * block / (1 << 30)
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(writers + 1)
    procs = [ctx.Process(target=_capacity_writer, args=(root, w, per_writer, size, cap_gb, start))
             for w in range(writers)]
    for p in procs:
        p.start()
    start.wait()
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, usage(root))
        time.sleep(0.002)
    for p in procs:
        p.join(30)
    limit = capacity_blocks * block
    return {"writers": writers, "blocks_written": writers * per_writer, "capacity_blocks": capacity_blocks,
            "peak_over_blocks": max(0.0, (peak - limit) / block), "final_over_blocks": max(0.0, (usage(root) - limit) / block)}


def _hot_reader(root: str, keys: list[bytes], size: int, stop, ready) -> None:
    store = UcmNfsStore({"storage_backends": root})
    dests = [np.zeros(size, np.uint8) for _ in keys]
    ready.set()
    while not stop.is_set():
        store.wait(store.load(keys, dests))
        time.sleep(0.05)
    store.close()


def hot_blocks(root: str, capacity_blocks: int = 16, size: int = 60 << 10) -> dict:
    cap_gb = capacity_blocks * file_size(size) / (1 << 30)
    writer = UcmNfsStore({"storage_backends": root, "capacity_gb": cap_gb})
    keys = [key_of(20_000 + i) for i in range(capacity_blocks)]
    writer.wait(writer.dump(keys, [block_for(k, size) for k in keys], [1] * len(keys)))
    hot = keys[::2]
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    reader = ctx.Process(target=_hot_reader, args=(root, hot, size, stop, ready))
    reader.start()
    ready.wait(60)
    time.sleep(1.6)  # past the default touch interval: the reads refresh the hot blocks' recency
    new = [key_of(30_000 + i) for i in range(capacity_blocks // 2)]
    writer.wait(writer.dump(new, [block_for(k, size) for k in new], [1] * len(new)))
    stop.set()
    reader.join(30)
    survived = sum(os.path.exists(writer.block_path(k)) for k in hot)
    writer.close()
    return {"hot": len(hot), "survived": survived}


# ---- lost root, FIFO, timeout -----------------------------------------------------------

def lost_root(root: str) -> dict:
    store = UcmNfsStore({"storage_backends": root})
    key = key_of(40_000)
    store.wait(store.dump([key], [block_for(key, 4096)], [1]))
    shutil.rmtree(root)
    t0 = time.perf_counter()
    refused = store.wait(store.dump([key_of(40_001)], [block_for(key_of(40_001), 4096)], [1])) == [False]
    seconds = time.perf_counter() - t0
    store.close()
    return {"dump_refused": refused, "tree_recreated": os.path.exists(root), "detected_within_s": round(seconds, 4)}


def fifo_timeout(root: str) -> dict:
    store = UcmNfsStore({"storage_backends": root, "io_threads": 1})
    stuck, fine = key_of(41_000), key_of(41_001)
    path = store.block_path(stuck)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    store.wait(store.dump([fine], [block_for(fine, 4096)], [1]))
    done, results = threading.Event(), []
    t0 = time.perf_counter()

    def load():
        results.extend(store.wait(store.load([stuck, fine], [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)])))
        done.set()

    threading.Thread(target=load, daemon=True).start()
    fifo_s = time.perf_counter() - t0 if done.wait(30) else None
    store.close()
    # A load that cannot finish in time: 64 MiB to verify on one IO thread, 1 ms allowed.
    keys = [key_of(42_000 + i) for i in range(16)]
    big = UcmNfsStore({"storage_backends": root})
    big.wait(big.dump(keys, [block_for(k, 4 << 20) for k in keys], [1] * 16))
    big.close()
    slow = UcmNfsStore({"storage_backends": root, "io_threads": 1, "load_timeout_s": 0.001})
    t0 = time.perf_counter()
    ok = slow.wait(slow.load(keys, [np.zeros(4 << 20, np.uint8) for _ in keys]))
    timeout_s = time.perf_counter() - t0
    timeouts = slow.stats().load_timeouts
    while slow.abandoned("load"):
        time.sleep(0.05)
    slow.close()
    return {"fifo_loads_returned_s": None if fifo_s is None else round(fifo_s, 4), "fifo_results": results,
            "timeout_load_returned_s": round(timeout_s, 4), "timed_out_blocks": timeouts,
            "timed_out_served": sum(ok)}


def _ledger_holder(path: str, locked, release) -> None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(120)


def ledger_lock(root: str, timeout_s: float = 0.5) -> dict:
    from ucm.store.usage_ledger import UsageLedger

    store = UcmNfsStore({"storage_backends": root, "capacity_gb": 1, "lookup_timeout_s": timeout_s,
                         "down_backoff_s": timeout_s})
    store.wait_open_scan(30)
    keys = [key_of(43_000 + i) for i in range(8)]
    blocks = [block_for(k, 64 << 10) for k in keys]
    ctx = mp.get_context("spawn")
    locked, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_ledger_holder, args=(os.path.join(root, ".ucm-usage"), locked, release))
    holder.start()
    locked.wait(30)
    returned_s, refused = [], 0
    for i in range(0, 8, 2):  # four dumps while the lock is held
        t0 = time.perf_counter()
        refused += store.wait(store.dump(keys[i:i + 2], blocks[i:i + 2], [1, 1])).count(False)
        returned_s.append(round(time.perf_counter() - t0, 4))
    written_while_held = len(blocks_on_disk(root))
    ledger_timeouts, down_refusals = store.stats().ledger_timeouts, store.stats().down_refusals
    release.set()
    holder.join()
    t0 = time.perf_counter()
    while not all(store.wait(store.dump(keys, blocks, [1] * 8))) and time.perf_counter() - t0 < 30:
        time.sleep(0.05)
    resumed_s = time.perf_counter() - t0
    store.close()
    usage = UsageLedger(root).update(lambda u: None)
    return {"lookup_timeout_s": timeout_s, "dump_returned_s": returned_s, "refused_blocks": refused,
            "ledger_timeouts": ledger_timeouts, "down_refusals": down_refusals,
            "written_while_held": written_while_held,
            "resumed_s": round(resumed_s, 3), "stored_after": len(blocks_on_disk(root)),
            "reservations_left": int(sum(r[0] for r in usage.reserved.values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI scale: seconds, not minutes")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (none: store_faults[_quick].json in the temporary directory)")
    args = ap.parse_args()
    q = args.quick
    out = args.out or Path(tempfile.gettempdir()) / ("store_faults_quick.json" if q else "store_faults.json")
    scenarios = {
        "concurrency": lambda d: concurrency(d, procs=4 if q else 8, seconds=4 if q else 60),
        "sigkill": lambda d: sigkill(d, kills=3 if q else 30),
        "corruption": lambda d: corruption(d, per_kind=3 if q else 30),
        "capacity": lambda d: capacity(d, writers=4, per_writer=24 if q else 96, capacity_blocks=16),
        "hot_blocks": lambda d: hot_blocks(d),
        "lost_root": lambda d: lost_root(d),
        "fifo_timeout": lambda d: fifo_timeout(d),
        "ledger_lock": lambda d: ledger_lock(d),
    }
    report: dict = {"quick": q}
    with tempfile.TemporaryDirectory(prefix="ucm-faults-") as tmp:
        for name, run in scenarios.items():
            t0 = time.perf_counter()
            report[name] = run(os.path.join(tmp, name))
            report[name]["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"{name:13s} {json.dumps(report[name])}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
