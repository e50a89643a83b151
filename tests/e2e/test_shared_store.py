"""The store's reason to exist: two engines (separate processes) on one store directory at once.

Chunks one engine stored are blended by the other, an exact prefix one computed is loaded by the
other, and the capacity limit holds across both while they write.
"""

from __future__ import annotations

from pathlib import Path

from blend_helpers import STORE_ALL, assert_same, prompts, run
from blend_helpers import params as sampling

from ucm.integration.vllm.llm import shutdown, ucm_transfer_config
from ucm.store.block_format import file_size

# Payload bytes of one 128-token block of the embedded model: 30 layers x (K, V) x 3 heads x 64 x fp32.
BLOCK_TOKENS = 128
BLOCK_FILE = file_size(BLOCK_TOKENS * 30 * 2 * 3 * 64 * 4)
CAPACITY_BLOCKS = 24


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvb") if p.is_file())


def test_two_engines_share_chunks_prefixes_and_one_capacity(model_dir, tmp_path, engine_factory, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # two more engines beside the session's
    store = tmp_path / "store"
    config = ucm_transfer_config(store, blend_ratio=0.15, capacity_gb=CAPACITY_BLOCKS * BLOCK_FILE / (1 << 30),
                                 blend_options=STORE_ALL)
    one = engine_factory(model_dir, kv_transfer_config=config)
    two = engine_factory(model_dir, kv_transfer_config=config)
    assert one.llm_engine.vllm_config.cache_config.block_size == BLOCK_TOKENS

    a, b = prompts(one, seed=601)
    first = run(one, a)
    prefix = run(two, a)  # the other engine computed it: an exact prefix from the store
    assert prefix.report["external_prefix_tokens"] >= len(a) - 2 * BLOCK_TOKENS
    assert_same(prefix, first)
    blended = run(two, b)  # the same passages reordered: the other engine's chunks, blended
    assert blended.report["blended"] and blended.report["chunk_hit_tokens"] > 0.8 * len(b) - 60

    # Both engines write many more blocks than the limit at the same time.
    flood = [prompts(one, seed=610 + i)[0] for i in range(12)]
    params = [{"prompt_token_ids": p} for p in flood]

    peak = 0
    for start in (0, 4, 8):
        for llm, part in ((one, params[start:start + 2]), (two, params[start + 2:start + 4])):
            llm.generate(part, sampling(max_tokens=1), use_tqdm=False)
            peak = max(peak, stored_bytes(store))
    shutdown(one)
    shutdown(two)  # their workers finish pending dumps on shutdown
    written = sum(len(p) // BLOCK_TOKENS for p in flood)
    assert written > 2 * CAPACITY_BLOCKS
    limit = CAPACITY_BLOCKS * BLOCK_FILE
    # In flight, each process may overshoot by the blocks it has reserved but not yet written.
    assert peak <= limit + 2 * 2 * BLOCK_FILE, (peak / BLOCK_FILE, CAPACITY_BLOCKS)
    assert stored_bytes(store) <= limit, (stored_bytes(store) / BLOCK_FILE, CAPACITY_BLOCKS)
