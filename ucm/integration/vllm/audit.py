"""Audit a shared KV store: recompute its EXACT blocks and report those whose KV is wrong.

Engines believe what they load (the checksum only proves a block holds what its writer wrote), so
a block written wrong by a bug, a faulty node or a hostile peer is served until evicted. Blocks do
not record their tokens: the operator gives prompts. One reference engine (UCM connector, prefix
offload only, empty scratch store) computes each in full (max_tokens=1) and dumps its full blocks
under the keys the audited store uses when the namespace matches (the writers' model, dtype, block
size, hash algorithm; PYTHONHASHSEED for xxhash). Each one also in the audited store is compared:
bad when max|stored - recomputed| > atol + rtol * max|recomputed| (defaults: measured noise, see
TOLERANCES). `--remove` unlinks bad blocks (all tensor-parallel shards); DRAM tiers and prefix
caches of engines that loaded one keep it until evicted.

Not checkable: CHUNK blocks of `chunk_store: "any"` hold KV computed after whatever text preceded
the chunk where it was first stored; recomputation cannot reproduce that. `chunk_store: "alone"`
stores a chunk only computed with nothing before it, as EXACT blocks: `--chunks MARKER` also sends
each marker-delimited chunk alone and checks its full blocks (never a chunk's partial last block).

    python -m ucm.integration.vllm.audit --store DIR --prompts prompts.jsonl [--remove] [--json OUT]

Exit status: 0 no bad block, 1 bad blocks (removed with --remove), 2 usage error or audit failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucm.argparse_help import HelpFormatter
from ucm.store.keys import KeyKind, shard_key, store_key

logger = logging.getLogger(__name__)

# (atol, rtol) per KV dtype: well above the recomputation noise of each dtype (batch shapes and
# CPUs round differently), far below a wrong block's difference, which is of the order of max|KV|
# (docs/serving.md, "Auditing a store").
TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-5, 1e-4), "bfloat16": (1e-2, 1e-1),
                                              "float16": (1e-3, 2e-2)}
SCRATCH_WAIT_S = 60.0  # the reference engine's dumps are asynchronous
PROMPTS_PER_STEP = 16  # prompts sent to the reference engine at a time
PROMPT_KEYS = frozenset({"prompt_token_ids", "prompt", "cache_salt"})


class AuditError(ValueError):
    """The audit cannot run as asked (exit status 2); the message names the problem."""


@dataclass
class BadBlock:
    key: str  # the block's store key, hex (tensor-parallel shards: the unsharded key)
    prompt: int  # index into the prompts file (first prompt holding the block)
    block: int  # block index within that prompt (or within its chunk)
    max_error: float
    removed: bool = False
    chunk: int | None = None  # --chunks: the block is one of this chunk of the prompt, computed alone


@dataclass
class AuditReport:
    prompts: int  # audited (after --sample)
    compared: int  # blocks found in both stores and compared
    missing: int  # full blocks of the prompts not in the audited store
    atol: float
    rtol: float
    max_error: float = 0.0  # largest difference of any compared block: the noise seen
    bad: list[BadBlock] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_prompts(lines: Iterable[str], source: str = "prompts") -> list[dict[str, Any]]:
    """vLLM prompt dicts from JSONL lines; blank lines are skipped, anything else malformed is an error."""
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise AuditError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise AuditError(f"{where}: expected an object, got {type(obj).__name__}")
        if unknown := sorted(set(obj) - PROMPT_KEYS):
            raise AuditError(f"{where}: unknown keys {unknown}; allowed: {sorted(PROMPT_KEYS)}")
        ids, text, salt = obj.get("prompt_token_ids"), obj.get("prompt"), obj.get("cache_salt")
        if (ids is None) == (text is None):
            raise AuditError(f"{where}: needs exactly one of 'prompt_token_ids' and 'prompt'")
        if ids is not None and not (isinstance(ids, list) and ids and all(
                type(t) is int and t >= 0 for t in ids)):
            raise AuditError(f"{where}: 'prompt_token_ids' must be a non-empty list of token ids (ints >= 0)")
        if text is not None and not (isinstance(text, str) and text):
            raise AuditError(f"{where}: 'prompt' must be a non-empty string")
        if salt is not None and not isinstance(salt, str):
            raise AuditError(f"{where}: 'cache_salt' must be a string")
        prompt: dict[str, Any] = {"prompt_token_ids": ids} if ids is not None else {"prompt": text}
        if salt:
            prompt["cache_salt"] = salt
        out.append(prompt)
    if not out:
        raise AuditError(f"{source}: no prompts")
    return out


def read_prompts(path: str | os.PathLike) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_prompts(f, str(path))
    except OSError as e:
        raise AuditError(f"--prompts: cannot read {path}: {e.strerror or e}") from None


def sample(count: int, n: int | None, seed: int) -> list[int]:
    """Indices of at most `n` of `count` prompts, chosen at random (reproducible by seed), in order."""
    if n is not None and n < 1:
        raise AuditError(f"--sample must be >= 1, got {n}")
    if n is None or n >= count:
        return list(range(count))
    return sorted(random.Random(seed).sample(range(count), n))


def tolerances(dtype: str, atol: float | None = None, rtol: float | None = None) -> tuple[float, float]:
    d_atol, d_rtol = TOLERANCES.get(dtype.removeprefix("torch."), TOLERANCES["bfloat16"])
    return (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)


def block_error(stored: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |stored - reference|, max |reference|) in float64; NaN in the stored KV is infinite."""
    diff = (stored.double() - reference.double()).abs().max().item()
    return (float("inf") if diff != diff else diff), reference.double().abs().max().item()


def shard_errors(reference: torch.Tensor, shards: Sequence[torch.Tensor | None]) -> list[tuple[float, float]]:
    """block_error of each tensor-parallel shard (flat payloads) against its heads of the full
    reference `[layers, tokens, 2, heads, head_size]` (the stored form); a missing or wrong-sized shard is infinite.
    Rank r of N holds heads from r*H//N on: H//N of them, or one (replicated) when N > H."""
    heads, out = reference.shape[3], []
    for r, got in enumerate(shards):
        first = r * heads // len(shards)
        want = reference[:, :, :, first:first + max(1, heads // len(shards))]
        ok = got is not None and got.numel() == want.numel()
        out.append(block_error(got.view(want.shape), want) if ok else (float("inf"), 0.0))
    return out


def is_bad(error: float, reference_max: float, atol: float, rtol: float) -> bool:
    return not error <= atol + rtol * reference_max


def _store_dir_of(llm) -> str:
    """The reference engine's scratch store; refuses an engine that would not recompute in full."""
    from ucm.config import UCMConfig

    kv = llm.llm_engine.vllm_config.kv_transfer_config
    if kv is None or kv.kv_connector != "UCMConnector":
        raise AuditError("the reference engine needs the UCM connector (ucm_transfer_config(scratch_dir))")
    config = UCMConfig.from_extra_config(kv.kv_connector_extra_config)
    if config.sparse is not None:
        raise AuditError("the reference engine must not use Blend: its blended blocks are approximate")
    return str(config.stores[0].config["storage_backends"])


def _check_dirs(store_dir: str) -> None:
    for d in str(store_dir).split(":"):  # opening a store would create a missing directory
        if not os.path.isdir(d):
            raise AuditError(f"store directory {d} does not exist")


def _open(store_dir: str):
    from ucm.store.nfs_store import UcmNfsStore

    _check_dirs(store_dir)
    # Reading must not refresh blocks' mtimes: the audit would make every block look recently used.
    return UcmNfsStore({"storage_backends": str(store_dir), "touch_interval_s": 1e12})


def _load(store, keys: Sequence[bytes], dtype: torch.dtype) -> list[torch.Tensor | None]:
    metas = store.read_meta(keys)
    bufs = [torch.empty(m.payload_len if m else 0, dtype=torch.uint8) for m in metas]
    live = [i for i, m in enumerate(metas) if m]
    ok = store.wait(store.load([keys[i] for i in live], [bufs[i].numpy() for i in live])) if live else []
    good = {i for i, o in zip(live, ok) if o}
    return [bufs[i].view(dtype) if i in good and len(bufs[i]) % dtype.itemsize == 0 else None
            for i in range(len(keys))]


def audit_store(store_dir: str | os.PathLike, reference, prompts: Sequence[dict[str, Any]], *,
                prompt_indices: Sequence[int] | None = None, shards: int = 1, atol: float | None = None,
                rtol: float | None = None, remove: bool = False, chunk_end_token_id: int | None = None
                ) -> AuditReport:
    """Audit the EXACT blocks of `prompts` in `store_dir` against `reference`, an LLM whose UCM
    connector (prefix offload only) stores into a scratch directory, never the audited one (it
    would load from it instead of computing). `shards`: the writers' tensor-parallel size;
    `chunk_end_token_id`: also audit each chunk (after the first) computed alone (`--chunks`)."""
    from ucm.integration.vllm.connector.ucm_connector import store_namespace
    from ucm.sparse.blend.chunking import split_by_marker
    from ucm.sparse.blend.hashing import BlockHasher, IsolationKeys

    scratch_dir = _store_dir_of(reference)
    if os.path.realpath(scratch_dir) == os.path.realpath(str(store_dir)):
        raise AuditError("the reference engine's connector points at the audited store; give it a scratch dir")
    config = reference.llm_engine.vllm_config
    mc, cache = config.model_config, config.cache_config
    if cache.prefix_caching_hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        raise AuditError(f"hash algorithm {cache.prefix_caching_hash_algo} needs PYTHONHASHSEED set to the writers'")
    if cache.cache_dtype != "auto":
        raise AuditError(f"KV cache dtype {cache.cache_dtype} is not supported (only 'auto')")
    heads, dtype = mc.get_total_num_kv_heads(), mc.dtype
    if shards < 1 or not (heads % shards == 0 or shards % heads == 0):
        raise AuditError(f"--shards {shards} does not split {heads} KV heads")
    atol, rtol = tolerances(str(dtype), atol, rtol)
    indices = list(prompt_indices) if prompt_indices is not None else list(range(len(prompts)))
    from vllm import SamplingParams

    namespace = store_namespace(config)
    hasher = BlockHasher.from_seed(cache.prefix_caching_hash_algo, cache.block_size, None)
    geometry = (-1, cache.block_size, 2, heads, mc.get_head_size())
    report = AuditReport(len(indices), 0, 0, atol, rtol)
    seen: set[bytes] = set()  # blocks shared by several prompts are compared once
    with _open(scratch_dir) as scratch, _open(str(store_dir)) as store:
        for g in range(0, len(indices), PROMPTS_PER_STEP):  # bounds the scratch store's disk and memory
            group = indices[g:g + PROMPTS_PER_STEP]
            outs = reference.generate([prompts[i] for i in group], SamplingParams(max_tokens=1), use_tqdm=False)
            jobs = [(i, None, list(out.prompt_token_ids)) for i, out in zip(group, outs)]
            if chunk_end_token_id is not None:  # chunk 0 is the prompt's own prefix
                jobs += [(i, c, tokens[span.start:span.end]) for i, _, tokens in list(jobs)
                         for c, span in enumerate(split_by_marker(tokens, chunk_end_token_id).chunks)
                         if c and span.end - span.start >= cache.block_size]
                reference.generate([_with_salt({"prompt_token_ids": t}, prompts[i]) for i, c, t in jobs if c],
                                   SamplingParams(max_tokens=1), use_tqdm=False)
            for i, chunk, tokens in jobs:
                iso = IsolationKeys(cache_salt=prompts[i].get("cache_salt"))
                extra = [iso.block_keys(b) for b in range(len(tokens) // cache.block_size)]
                blocks = {store_key(namespace, KeyKind.EXACT, h): b
                          for b, h in enumerate(hasher.prefix_hashes(tokens, extra_keys=extra))}
                keys = [k for k in blocks if k not in seen]
                seen.update(keys)
                _compare(report, scratch, store, keys, (i, chunk), blocks, shards, geometry, dtype, remove)
    return report


def _with_salt(prompt: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    return {**prompt, "cache_salt": original["cache_salt"]} if original.get("cache_salt") else prompt


def _compare(report: AuditReport, scratch, store, keys: list[bytes], where: tuple[int, int | None],
             blocks: dict[bytes, int], shards: int, geometry: tuple[int, ...], dtype: torch.dtype,
             remove: bool) -> None:
    """Compares one prompt's blocks (the reference engine's dumps are asynchronous: waits for
    them) and drops them from the scratch store."""
    deadline = time.monotonic() + SCRATCH_WAIT_S
    while not all(found := scratch.lookup(keys)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reference engine stored {sum(found)} of {len(keys)} blocks: it keys "
                               "blocks differently from this audit (hash seed?) or its store is failing")
        time.sleep(0.1)
    shard_keys = {k: [shard_key(k, r, shards) for r in range(shards)] for k in keys}
    present = [k for k, held in zip(keys, store.lookup_shards(keys, shards)) if held]
    report.missing += len(keys) - len(present)
    refs = _load(scratch, present, dtype)
    stored = _load(store, [s for k in present for s in shard_keys[k]], dtype)
    for j, (key, ref) in enumerate(zip(present, refs)):
        if ref is None:
            raise RuntimeError(f"cannot read the reference block {key.hex()} from the scratch store")
        errors = shard_errors(ref.view(geometry), stored[j * shards:(j + 1) * shards])
        err = max(e for e, _ in errors)
        report.compared += 1
        report.max_error = max(report.max_error, err)
        if any(is_bad(e, m, report.atol, report.rtol) for e, m in errors):
            bad = BadBlock(key.hex(), where[0], blocks[key], err, chunk=where[1])
            bad.removed = remove and _remove(store, shard_keys[key])
            report.bad.append(bad)
    _remove(scratch, keys)


def _remove(store, keys: Sequence[bytes]) -> bool:
    """Unlinks a block's files (the store has no delete call; capacity ledgers catch up at their next scan)."""
    for key in keys:
        try:
            os.unlink(store.block_path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.error("cannot remove %s: %s", store.block_path(key), e)
            return False
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ucm.integration.vllm.audit",
                                description="Recompute a shared KV store's EXACT blocks for the given prompts and\n"
                                "report (or --remove) those whose KV differs beyond the dtype's noise.",
                                formatter_class=HelpFormatter)
    p.add_argument("--store", required=True, metavar="DIR",
                   help="the audited store directory (its storage_backends; several separated by ':')")
    p.add_argument("--prompts", required=True, metavar="FILE", help='JSONL, one per line: {"prompt_token_ids": '
                   '[...]} or {"prompt": "text"}, optionally with "cache_salt"')
    p.add_argument("--model", help="the writers' model (default: the embedded model, python -m ucm.models)")
    p.add_argument("--dtype", default="float32", help="the writers' dtype: any other matches no stored block")
    p.add_argument("--block-size", type=int, help="the writers' KV block size (default: vLLM's)")
    p.add_argument("--hash-algo", help="the writers' prefix_caching_hash_algo (default: vLLM's, sha256); "
                   "xxhash algorithms need the writers' PYTHONHASHSEED")
    p.add_argument("--shards", type=int, default=1, help="the writers' tensor_parallel_size")
    p.add_argument("--sample", type=int, metavar="N", help="audit at most N prompts, chosen at random (all if unset)")
    p.add_argument("--seed", type=int, default=0, help="random seed of --sample")
    p.add_argument("--atol", type=float, help=f"absolute tolerance (default per dtype: {TOLERANCES})")
    p.add_argument("--rtol", type=float, help="tolerance relative to the block's max |KV| (default per dtype)")
    p.add_argument("--chunks", type=int, metavar="MARKER", help="also audit each chunk ending in token MARKER (the "
                   "writers' Blend chunk_end_token_id) computed alone: chunk blocks of chunk_store 'alone' stores")
    p.add_argument("--remove", action="store_true", help="delete the bad blocks from the store")
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    return p


def _run(args: argparse.Namespace, prompts: list[dict[str, Any]], indices: list[int]) -> AuditReport:
    from ucm.integration.vllm.llm import make_llm, shutdown, ucm_transfer_config

    model = args.model
    if model is None:
        from ucm.models import prepare

        model = str(prepare())
    overrides: dict[str, Any] = {"dtype": args.dtype}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.hash_algo is not None:
        overrides["prefix_caching_hash_algo"] = args.hash_algo
    with tempfile.TemporaryDirectory(prefix="ucm-audit-") as scratch:
        llm = make_llm(model, kv_transfer_config=ucm_transfer_config(scratch), **overrides)
        try:
            return audit_store(args.store, llm, prompts, prompt_indices=indices, shards=args.shards,
                               atol=args.atol, rtol=args.rtol, remove=args.remove, chunk_end_token_id=args.chunks)
        finally:
            shutdown(llm)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        prompts = read_prompts(args.prompts)
        indices = sample(len(prompts), args.sample, args.seed)
        _check_dirs(args.store)
        if args.shards < 1:
            raise AuditError(f"--shards must be >= 1, got {args.shards}")
        if (args.hash_algo or "").startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            raise AuditError(f"--hash-algo {args.hash_algo} needs PYTHONHASHSEED set to the writers' value")
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise AuditError(f"--json: directory of {args.json} does not exist")
        report = _run(args, prompts, indices)
    except AuditError as e:
        print(f"audit: error: {e}", file=sys.stderr)
        return 2
    except Exception:  # exit status 1 means bad blocks only
        logger.exception("audit: could not run")
        return 2
    print(f"audited {report.prompts} prompts: {report.compared} blocks compared, {report.missing} not in the store, "
          f"{len(report.bad)} bad (largest difference {report.max_error:.3g}; tolerance {report.atol:g} + "
          f"{report.rtol:g} * max|KV|)")
    for bad in report.bad:
        chunk = "" if bad.chunk is None else f" chunk {bad.chunk}"
        print(f"bad block {bad.key}: prompt {bad.prompt}{chunk} block {bad.block}, max error {bad.max_error:.3g}"
              + (" (removed)" if bad.removed else ""))
    if report.compared == 0 and report.missing:
        print("none of the prompts' blocks is in the store: --model, --dtype, --block-size, --hash-algo (and "
              "PYTHONHASHSEED, cache_salt) must be those of the engines that wrote it", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 1 if report.bad else 0


if __name__ == "__main__":
    sys.exit(main())
