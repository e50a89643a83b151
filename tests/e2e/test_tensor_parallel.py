"""Tensor parallelism: the store serves TP=2 engines, and only engines of the same TP size.

A TP=2 engine keeps half of the KV heads on each rank, so each rank stores its own shard of a
block; a TP=1 engine on the same store directory must never load those shards as whole blocks.

The model is a tiny random-weight Llama (4 query / 2 KV heads of 64, 4 layers) saved as real
weights (vLLM's "dummy" weights give flat logits, whose argmax flips with the all-reduce order),
so TP=1 and TP=2 agree on greedy tokens and logprobs to about 1e-5.

Three engines, each in its own process (they need different VLLM_CPU_OMP_THREADS_BIND values,
and a fresh process is what proves the store, not vLLM's own cache, served the blocks):
  A  TP=2, prefix offload only: computes prompt P and dumps its blocks.
  B  TP=2, Blend: P again (loaded from the store), then the chunked prompt in one order (dumps its
     chunks) and reordered at ratio 1.0 (chunks loaded, every loaded token recomputed) and 0.0
     (chunks loaded and kept: only this one sees whether each rank got its own heads back).
  C  TP=1, Blend: the references (full prefill: cache salt, Blend off), then P and the reordered
     prompt unsalted, which must find none of the TP=2 blocks, then B's chunk reuse with TP=1's
     own chunks (another salt), the reference of B's ratio 0.0.
Where vLLM cannot start a TP=2 engine on the host (fewer than 2 cores, a platform without TP on
this build), the tests skip with vLLM's error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MARKER = 2  # chunk end token of the chunked prompt (<|im_end|> in the copied tokenizer)
LOGPROB_TOL = 1e-3  # TP=1 vs TP=2: the all-reduce sums in another order (measured ~1e-5)
PHASE_TIMEOUT_S = 300
STARTED = "UCM_TP_TEST_STARTED"
RESULT = "UCM_TP_TEST_RESULT "
CONNECTOR_MODULE = "ucm.integration.vllm.connector.ucm_connector"
# vLLM's wrappers around a worker's or the engine core's own exception.
GENERIC_ERRORS = ("Engine core initialization failed", "Worker failed with error", "WorkerProc initialization failed")

# P: an exact prefix of 3 full blocks and a tail, no chunk marker (so Blend engines plan no chunks).
PREFIX_PROMPT = [3000 + (11 * j) % 40000 for j in range(450)]
PASSAGES = [[1000 + 7 * i + j for j in range(150 + 40 * i)] + [MARKER] for i in range(3)]
QUESTION = [500 + j for j in range(12)]
FIRST = [t for p in PASSAGES for t in p] + QUESTION
REORDERED = [t for p in PASSAGES[::-1] for t in p] + QUESTION


def tiny_llama(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A 4-layer Llama with 2 KV heads (one per TP=2 rank) and seeded random weights."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    hidden, inter, layers, vocab, head, heads, kv_heads = 256, 512, 4, 49152, 64, 4, 2
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }))
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols, std):
        return (torch.randn(rows, cols, generator=g) * std).contiguous()

    # Embeddings (tied with the LM head) at std 0.2: logits of std ~3, a clear greedy argmax.
    tensors = {"model.embed_tokens.weight": w(vocab, hidden, 0.2), "model.norm.weight": torch.ones(hidden)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = w(heads * head, hidden, hidden ** -0.5)
        tensors[p + "self_attn.k_proj.weight"] = w(kv_heads * head, hidden, hidden ** -0.5)
        tensors[p + "self_attn.v_proj.weight"] = w(kv_heads * head, hidden, hidden ** -0.5)
        tensors[p + "self_attn.o_proj.weight"] = w(hidden, heads * head, (heads * head) ** -0.5)
        tensors[p + "mlp.gate_proj.weight"] = w(inter, hidden, hidden ** -0.5)
        tensors[p + "mlp.up_proj.weight"] = w(inter, hidden, hidden ** -0.5)
        tensors[p + "mlp.down_proj.weight"] = w(hidden, inter, inter ** -0.5)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- one engine in a subprocess ----------------------------------------------------------------


def phase_env(tp: int) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("UCM_BLEND_NO_MODELS", None)  # Blend needs the plugin's model classes
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if tp == 1:
        if bind.count("|"):
            env.pop("VLLM_CPU_OMP_THREADS_BIND")
    elif bind.count("|") != tp - 1:
        # vLLM's automatic binding wants one NUMA node per rank: name one core per rank instead.
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tp])
    return env


class Phase:
    def __init__(self, name: str, log: Path, rc: int | None, started: bool, result: dict | None, wall_s: float):
        self.name, self.log, self.rc, self.started, self.result, self.wall_s = name, log, rc, started, result, wall_s

    @property
    def ok(self) -> bool:
        return self.result is not None

    def error(self, lines: int = 12) -> str:
        """The exceptions the log names (root causes first, vLLM's wrappers dropped), then its tail."""
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        causes: list[str] = []
        for ln in text:
            m = re.search(r"\b(\w+(?:Error|Exception): .*)", ln)
            if m and not any(w in m.group(1) for w in GENERIC_ERRORS) and m.group(1) not in causes:
                causes.append(m.group(1))
        timed_out = [f"timed out after {PHASE_TIMEOUT_S} s"] if self.rc is None else []
        return (f"engine {self.name} (rc={self.rc}, log {self.log}): " + " | ".join(timed_out + causes[:3])
                + "".join("\n" + ln for ln in text[max(0, len(text) - lines):]))

    def request(self, name: str) -> dict:
        if not self.ok:
            pytest.fail(self.error())
        return self.result["requests"][name]


def run_phase(root: Path, name: str, spec: dict) -> Phase:
    """Start one engine in a new process group, run `spec["requests"]`, stop every process of it."""
    log = root / f"engine-{name}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        env = phase_env(spec["tp"])
        if spec.get("faults_file"):  # the stages each request names are injected in the engine's processes
            env["UCM_FAULTS"] = spec["faults_file"]
        proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # vLLM's engine core and workers are in this group too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = log.read_text(errors="replace")
    result = None
    for line in text.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
    return Phase(name, log, rc, STARTED in text, result, time.monotonic() - start)


def block_files(store: str | None) -> set[Path]:
    return set(Path(store).rglob("*.kvb")) if store else set()


def corrupt_files(files: list[Path]) -> int:
    """Flips the last payload byte of each file (its checksum then fails)."""
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 0xFF]))
    return len(files)


def engine_main(spec: dict) -> None:
    """The subprocess: one engine, the requests in order, then a JSON line with what they gave."""
    from blend_helpers import STORE_ALL, run  # this file's folder is sys.path[0] here

    from ucm.integration.vllm.connector.stats import ucm_counters
    from ucm.integration.vllm.llm import make_llm, shutdown, ucm_transfer_config

    kwargs: dict = {"tensor_parallel_size": spec["tp"], "max_model_len": 4096, "disable_log_stats": False,
                    "enforce_eager": True}
    if spec.get("store"):
        kv = ucm_transfer_config(spec["store"], blend_ratio=0.15 if spec["blend"] else None,
                                 chunk_end_token_id=MARKER, blend_options=STORE_ALL)
        kv.kv_connector_module_path = CONNECTOR_MODULE
        kwargs["kv_transfer_config"] = kv
    t0 = time.perf_counter()
    llm = make_llm(spec["model"], **kwargs)
    print(STARTED, flush=True)
    out = {"start_s": round(time.perf_counter() - t0, 1), "requests": {}}
    written: dict[str, list[Path]] = {}
    for req in spec["requests"]:
        corrupted = 0
        if spec.get("faults_file"):
            Path(spec["faults_file"]).write_text(req.get("faults", ""))
        if req.get("faults") or req.get("fresh"):
            llm.reset_prefix_cache()  # the prompt is blended, not found in vLLM's own cache
        if req.get("corrupt"):  # every other file the named request wrote: one rank's shard of some blocks
            llm.reset_prefix_cache()  # the prompt is then read from the store, not vLLM's own cache
            corrupted = corrupt_files([f for f in written[req["corrupt"]] if f.exists()][::2])
        before = block_files(spec.get("store"))
        t = time.perf_counter()
        r = run(llm, req["tokens"], cache_salt=req.get("salt"), **req.get("kw", {}))
        written[req["name"]] = sorted(block_files(spec.get("store")) - before)
        out["requests"][req["name"]] = {"tokens": r.tokens, "logprobs": r.logprobs, "report": r.report,
                                        "counters": ucm_counters(llm.get_metrics()),
                                        "s": round(time.perf_counter() - t, 2), "corrupted_files": corrupted,
                                        "written_files": len(written[req["name"]])}
    shutdown(llm)
    print(RESULT + json.dumps(out), flush=True)


# ---- the engines, shared by the checks ---------------------------------------------------------


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(cpus) < 2:
        pytest.skip(f"tensor_parallel_size=2 needs 2 cores for vLLM's CPU workers; this process may use {len(cpus)}")
    root = tmp_path_factory.mktemp("tp")
    model = str(tiny_llama(model_dir, root / "tiny-llama"))
    store = str(root / "store")

    def req(name, tokens, salt=None, **kw):
        return {"name": name, "tokens": tokens, "salt": salt, "kw": kw}

    a = run_phase(root, "A-tp2-prefix", {"model": model, "tp": 2, "store": store, "blend": False,
                                         "requests": [req("P", PREFIX_PROMPT)]})
    if not a.started:
        # Is it TP=2 itself the host cannot run, or our connector at TP=2? Only asked on failure.
        probe = run_phase(root, "probe-tp2-plain", {"model": model, "tp": 2, "store": None, "blend": False,
                                                    "requests": [req("P", PREFIX_PROMPT)]})
        if not probe.started:
            pytest.skip("vLLM cannot start tensor_parallel_size=2 here: " + probe.error(0))
    b = None
    if a.ok:
        b = run_phase(root, "B-tp2-blend", {"model": model, "tp": 2, "store": store, "blend": True, "requests": [
            req("P", PREFIX_PROMPT),
            req("first", FIRST),
            req("reordered", REORDERED, ratio=1.0),
            req("reuse", REORDERED, ratio=0.0),  # the blocks blended above never serve it: chunks loaded again
            req("sparse", REORDERED, ratio=0.15),
        ]})
    # One rank's shard of some chunk and exact blocks corrupted (every other file a request wrote,
    # in name order: each a shard of one rank): the ranks must agree to recompute those blocks.
    # Then an exception on rank 1 alone in the Blend forward (its selection, a layer's attention):
    # both ranks must fall back together, not leave rank 0 waiting in a collective.
    d = run_phase(root, "D-tp2-faults", {"model": model, "tp": 2, "store": str(root / "store-d"), "blend": True,
                                         "faults_file": str(root / "faults-d"), "requests": [
        req("first", FIRST),
        {**req("reordered", REORDERED, ratio=1.0), "corrupt": "first"},
        req("P", PREFIX_PROMPT),
        {**req("P_again", PREFIX_PROMPT), "corrupt": "P"},  # its exact prefix blocks
        req("f_first", FIRST, salt="faults"),
        {**req("f_select", REORDERED, salt="faults", ratio=0.15), "faults": "select@1"},
        {**req("f_attention", REORDERED, salt="faults", ratio=0.15), "faults": "attention@1"},
        {**req("f_after", REORDERED, salt="faults", ratio=0.15), "fresh": True},
    ]}) if a.ok else None
    c = run_phase(root, "C-tp1-blend", {"model": model, "tp": 1, "store": store, "blend": True, "requests": [
        req("ref_P", PREFIX_PROMPT, salt="reference", disable=True),
        req("ref_reordered", REORDERED, salt="reference", disable=True),
        req("P", PREFIX_PROMPT),
        req("reordered", REORDERED, ratio=1.0),
        # TP=1's own chunks (another salt: apart from the TP=2 blocks), reused as B reused TP=2's.
        req("first", FIRST, salt="tp1"),
        req("reuse", REORDERED, salt="tp1", ratio=0.0),
        req("sparse", REORDERED, salt="tp1", ratio=0.15),
    ]})
    for p in (a, b, c, d):
        if p is not None:
            print(f"engine {p.name}: {p.wall_s:.0f} s, start {p.result['start_s'] if p.ok else '-'} s, "
                  f"ok={p.ok}, log {p.log}")
    return {"A": a, "B": b, "C": c, "D": d}


def assert_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"], (got["tokens"], want["tokens"])
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    assert max(diffs) <= LOGPROB_TOL, (got["logprobs"], want["logprobs"])


def test_tp2_prefix_offload_loads_in_a_new_engine(engines):
    """(a) A TP=2 engine dumps P; a fresh TP=2 engine loads it and gives TP=1 full prefill's tokens."""
    a = engines["A"]
    first = a.request("P")
    assert first["report"]["external_prefix_tokens"] == 0 and first["report"]["dumped_blocks"] > 0
    b = engines["B"]
    assert b is not None
    loaded = b.request("P")
    assert loaded["report"]["external_prefix_tokens"] > 0, loaded["report"]
    assert loaded["counters"].get("loaded_blocks", 0) > 0 and not loaded["counters"].get("failed_blocks")
    assert_same(loaded, engines["C"].request("ref_P"))


def test_tp2_blend_ratio_one_matches_tp1_full_prefill(engines):
    """(b) Blend at ratio 1.0 on TP=2, chunks stored by an earlier request: TP=1 full prefill's tokens."""
    b = engines["B"]
    if b is None:
        pytest.fail(engines["A"].error())
    assert b.request("first")["report"]["dumped_blocks"] > 0
    blended = b.request("reordered")
    assert blended["report"]["blended"] and blended["report"]["chunk_hit_tokens"] > 400, blended["report"]
    assert not blended["counters"].get("failed_blocks"), blended["counters"]
    reference = engines["C"].request("ref_reordered")
    assert not reference["report"]["blended"]
    assert_same(blended, reference)


def test_tp2_chunk_reuse_matches_tp1_chunk_reuse(engines):
    """(b') Ratio 0.0 keeps the loaded KV (ratio 1.0 recomputes all of it, so it cannot tell whether
    each rank loaded its own heads): TP=2 reusing TP=2 chunks must match TP=1 reusing TP=1 chunks."""
    b = engines["B"]
    if b is None:
        pytest.fail(engines["A"].error())
    reuse = b.request("reuse")
    assert reuse["report"]["blended"] and reuse["report"]["chunk_hit_tokens"] > 400, reuse["report"]
    reference = engines["C"].request("reuse")
    assert reference["report"]["blended"] and reference["report"]["chunk_hit_tokens"] > 400, reference["report"]
    assert_same(reuse, reference)


def test_tp2_blend_recomputes_the_rows_tp1_recomputes(engines):
    """Blend at 0.15: the deviation and the probe's attention are all-reduced over the ranks, so
    both ranks rank with TP=1's scores and recompute the same rows; a rank choosing other rows
    would mix two selections' KV and leave TP=1's answer."""
    b = engines["B"]
    if b is None:
        pytest.fail(engines["A"].error())
    sparse, reference = b.request("sparse"), engines["C"].request("sparse")
    for got in (sparse, reference):
        assert got["report"]["blended"] and got["report"]["ratio"] == 0.15, got["report"]
    assert sparse["tokens"] == reference["tokens"], (sparse["tokens"], reference["tokens"])


def test_one_ranks_corrupt_shards_are_recomputed_by_both_ranks(engines):
    """One rank's shard of some blocks fails its checksum: the ranks agree on each block's load
    outcome, so both recompute those blocks (no hang, no rank running other rows than the other),
    the answers equal TP=1 full prefill's, and nothing computed over the failed loads is stored."""
    d = engines["D"]
    if d is None:
        pytest.fail(engines["A"].error())
    c = engines["C"]
    reordered = d.request("reordered")
    assert reordered["corrupted_files"] > 0 and reordered["report"]["blended"], reordered["report"]
    assert reordered["counters"].get("failed_blocks", 0) > 0, reordered["counters"]
    assert_same(reordered, c.request("ref_reordered"))
    again = d.request("P_again")  # the exact prefix blocks "P" stored, some shards corrupt
    assert again["corrupted_files"] > 0 and again["report"]["external_prefix_tokens"] > 0, again["report"]
    assert again["counters"]["failed_blocks"] > reordered["counters"]["failed_blocks"], again["counters"]
    assert_same(again, c.request("ref_P"))


def test_a_fault_on_one_rank_in_the_blend_forward_falls_back_on_both(engines):
    """An exception on rank 1 alone in the selection or in a layer's attention: rank 0 does not
    wait for it in a collective (the phase would time out); both ranks hand the request to vLLM,
    whose answer is TP=1 full prefill's, nothing of it is stored, and the next request blends."""
    d = engines["D"]
    if d is None:
        pytest.fail(engines["A"].error())
    c = engines["C"]
    for name in ("f_select", "f_attention"):
        got = d.request(name)
        assert got["report"]["fallback"] == "blend_error" and not got["report"]["blended"], (name, got["report"])
        assert got["written_files"] == 0, (name, got["written_files"])
        assert_same(got, c.request("ref_reordered"))
    assert d.request("f_attention")["counters"].get("blend_fallbacks_blend_error", 0) >= 2
    after = d.request("f_after")
    assert after["report"]["blended"] and after["report"]["fallback"] is None, after["report"]
    assert after["tokens"] == c.request("sparse")["tokens"]


def test_tp1_engine_never_loads_tp2_blocks(engines):
    """(c) A TP=1 engine on the TP=2 engines' store finds neither their prefix nor their chunk blocks."""
    c = engines["C"]
    prefix = c.request("P")
    assert prefix["report"]["external_prefix_tokens"] == 0, prefix["report"]
    chunks = c.request("reordered")
    assert chunks["report"]["chunk_hit_tokens"] == 0, chunks["report"]
    counters = chunks["counters"]  # cumulative over the engine's first four requests
    assert counters.get("loaded_blocks", 0) == 0 and counters.get("failed_blocks", 0) == 0, counters
    assert_same(prefix, c.request("ref_P"))
    assert_same(chunks, c.request("ref_reordered"))


if __name__ == "__main__":
    engine_main(json.loads(sys.argv[1]))
