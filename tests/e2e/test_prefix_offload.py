"""Prefix offload: exact KV computed by one engine is loaded by a new engine process."""

from blend_helpers import assert_same, run
from conftest import shutdown, ucm_transfer_config

from ucm.eval.datasets import generate_synthetic


def test_new_engine_loads_offloaded_prefix(model_dir, tmp_path, engine_factory, plain_llm):
    tok = plain_llm.get_tokenizer()
    text = " ".join(generate_synthetic(num_examples=1, passages_per_example=2, passage_words=200, seed=201)[0].passages)
    prompt = tok.encode(text, add_special_tokens=False)[:450]  # 3 full blocks of 128 and a tail
    store = tmp_path / "store"

    a = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store))
    first = run(a, prompt)
    assert first.report["external_prefix_tokens"] == 0 and first.report["dumped_blocks"] == 3
    shutdown(a)  # its worker finishes pending dumps on shutdown

    b = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(store))
    second = run(b, prompt)
    assert second.report["external_prefix_tokens"] == 384
    assert second.report["dumped_blocks"] == 0
    assert_same(second, run(plain_llm, prompt))
