"""The store audit recomputes stored EXACT blocks and finds a wrong one by its key.

One writer (Blend, so the store also holds chunk blocks and a blended prompt whose later blocks
are not stored), the session's reference engine for the function, and the CLI once (its own engine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from vllm import SamplingParams
from blend_helpers import MARKER, prompts, run, wait_until_stable

from ucm.integration.vllm.audit import audit_store, tolerances
from ucm.integration.vllm.connector.ucm_connector import store_namespace
from ucm.integration.vllm.llm import shutdown, ucm_transfer_config
from ucm.sparse.blend.chunking import split_by_marker
from ucm.sparse.blend.hashing import BlockHasher, IsolationKeys
from ucm.store.keys import KeyKind, shard_key, store_key
from ucm.store.nfs_store import UcmNfsStore


def _keys(llm, token_ids, salt=None) -> list[bytes]:
    """EXACT keys of a prompt's full blocks, computed independently of the audit."""
    config = llm.llm_engine.vllm_config
    bs = config.cache_config.block_size
    hasher = BlockHasher.from_seed(config.cache_config.prefix_caching_hash_algo, bs, None)
    extra = [IsolationKeys(cache_salt=salt).block_keys(b) for b in range(len(token_ids) // bs)]
    namespace = store_namespace(config)
    return [store_key(namespace, KeyKind.EXACT, h) for h in hasher.prefix_hashes(token_ids, extra_keys=extra)]


def _payloads(store, keys) -> list[torch.Tensor]:
    bufs = [torch.empty(m.payload_len, dtype=torch.uint8) for m in store.read_meta(keys)]
    assert store.wait(store.load(keys, [b.numpy() for b in bufs])) == [True] * len(keys)
    return [b.view(torch.float32) for b in bufs]


def test_audit_finds_and_removes_a_wrong_block(engine_factory, audit_reference, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the writer and the CLI's engine beside the session's
    store_dir = tmp_path / "store"
    writer = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store_dir, blend_ratio=0.15))
    (first0, reordered0), (first1, _) = prompts(writer, seed=511), prompts(writer, seed=512)
    text = "The audit " + " ".join(f"fact {i} is {i * 7 % 13}." for i in range(60))
    audited = [{"prompt_token_ids": list(first0)}, {"prompt_token_ids": list(first1)},
               {"prompt_token_ids": list(first0), "cache_salt": "tenant-b"}, {"prompt": text},
               {"prompt_token_ids": list(reordered0)}]
    for p in audited[:4]:
        writer.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)
    assert run(writer, reordered0, max_tokens=1).report["blended"]  # its blended blocks are not stored EXACT
    span = split_by_marker(first1, MARKER).chunks[2]
    run(writer, first1[span.start:span.end], max_tokens=1, disable=True)  # a chunk alone, as "alone" stores keep
    shutdown(writer)
    assert wait_until_stable(store_dir) > 0

    ref = audit_reference
    clean = audit_store(store_dir, ref, audited)
    atol, rtol = tolerances("float32")
    assert (clean.prompts, clean.bad, clean.atol, clean.rtol) == (5, [], atol, rtol)
    assert clean.compared >= 3 * 8 and clean.missing > 0, clean
    print(f"float32 recomputation noise: {clean.max_error:.3g} over {clean.compared} blocks")

    # A wrong but well-formed block: another block's KV under the victim's key, valid checksum.
    victim, donor = _keys(ref, first1)[2], _keys(ref, first0)[2]
    assert victim != donor
    with UcmNfsStore({"storage_backends": str(store_dir)}) as store:
        payload = _payloads(store, [donor])[0]
        Path(store.block_path(victim)).unlink()
        assert store.wait(store.dump([victim], [payload.numpy()], [128])) == [True]

    prompts_file, out = tmp_path / "prompts.jsonl", tmp_path / "report.json"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in audited))
    cli = subprocess.run([sys.executable, "-m", "ucm.integration.vllm.audit", "--store", str(store_dir),
                          "--prompts", str(prompts_file), "--json", str(out), "--remove", "--chunks", str(MARKER)],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 1, cli.stdout + cli.stderr[-3000:]
    print(cli.stdout)
    report = json.loads(out.read_text())
    assert [(b["key"], b["prompt"], b["block"], b["removed"]) for b in report["bad"]] == [(victim.hex(), 1, 2, True)]
    assert report["bad"][0]["max_error"] > 1.0 and f"bad block {victim.hex()}" in cli.stdout
    assert report["compared"] == clean.compared + (span.end - span.start) // 128  # + the chunk sent alone

    after = audit_store(store_dir, ref, audited)
    assert after.bad == [] and after.compared == clean.compared - 1 and after.missing == clean.missing + 1

    # Tensor-parallel stores: one file per rank's heads; a rank's wrong shard is found.
    sharded = tmp_path / "sharded"
    keys = _keys(ref, first0)
    with UcmNfsStore({"storage_backends": str(store_dir)}) as store, \
            UcmNfsStore({"storage_backends": str(sharded)}) as out_store:
        for b, (key, kv) in enumerate(zip(keys, _payloads(store, keys))):
            heads = kv.view(-1, 128, 2, 3, 64)  # the stored form: layer-major
            parts = [heads[:, :, :, r:r + 1].contiguous() for r in range(3)]
            if b == 3:
                parts[1] = heads[:, :, :, 0:1].contiguous()  # rank 1 stored rank 0's head
            task = out_store.dump([shard_key(key, r, 3) for r in range(3)], [p.numpy() for p in parts], [128] * 3)
            assert out_store.wait(task) == [True] * 3
    tp = audit_store(sharded, ref, audited[:1], shards=3)
    assert tp.compared == len(keys) and [(b.key, b.prompt, b.block) for b in tp.bad] == [(keys[3].hex(), 0, 3)]
