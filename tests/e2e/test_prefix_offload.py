"""Prefix offload: exact KV computed by one engine is loaded by a new engine process, and a
damaged stored block is recomputed instead of being served or failing the request."""

import time

from blend_helpers import assert_same, run
from ucm.integration.vllm.llm import shutdown, ucm_transfer_config

from ucm.eval.datasets import generate_synthetic


def wait_for_blocks(store, count, timeout=30.0):
    """Dumps finish asynchronously; wait until `count` block files are visible."""
    deadline = time.monotonic() + timeout
    while True:
        files = {p for p in store.rglob("*.kvb") if p.is_file()}
        if len(files) >= count or time.monotonic() > deadline:
            return files
        time.sleep(0.1)


def test_new_engine_loads_offloaded_prefix(model_dir, tmp_path, engine_factory, plain_llm):
    tok = plain_llm.get_tokenizer()
    passages = generate_synthetic(num_examples=1, passages_per_example=4, passage_words=200, seed=201)[0].passages
    clean = tok.encode(" ".join(passages[:2]), add_special_tokens=False)[:450]  # 3 full blocks and a tail
    damaged = tok.encode(" ".join(passages[2:]), add_special_tokens=False)[:450]
    store = tmp_path / "store"

    a = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store))
    first = run(a, clean)
    assert first.report["external_prefix_tokens"] == 0 and first.report["dumped_blocks"] == 3
    clean_files = wait_for_blocks(store, 3)
    assert run(a, damaged).report["dumped_blocks"] == 3
    shutdown(a)  # its worker finishes pending dumps on shutdown

    # Flip the last payload byte of every block the second prompt stored: checksums must catch it.
    damaged_files = wait_for_blocks(store, 6) - clean_files
    assert len(damaged_files) == 3
    for path in damaged_files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    b = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store))
    second = run(b, clean)
    assert second.report["external_prefix_tokens"] == 384 and second.report["dumped_blocks"] == 0
    assert_same(second, run(plain_llm, clean))
    recomputed = run(b, damaged)  # lookup hits, loads fail their checksum, vLLM recomputes
    assert_same(recomputed, run(plain_llm, damaged))
