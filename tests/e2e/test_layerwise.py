"""Layer-wise loading on the real engine (`use_layerwise`, the default): a Blend step's chunk KV
read in layer groups while its forward runs gives the answers of whole loads before the forward,
and blocks whose later layers fail to load send the step to vLLM's computation, nothing of it
stored."""

from __future__ import annotations

from blend_helpers import STORE_ALL, assert_same, block_files, forget_local_prefix_cache, prompts, run, wait_until_stable


def test_layerwise_loads_give_the_whole_loads_answers_and_late_faults_fall_back(model_dir, tmp_path, engine_factory,
                                                                                 blend_llm, store_dir):
    """The same KV lands before each layer reads it: the session's engine (layer-wise, the
    default) gives the default rule's and HKVD's log-probabilities of an engine that loads whole
    blocks before the forward. Then each block this test stored is damaged in its last layer: the
    first group's reads pass, the last group's fail, the step's Blend forward falls back, and the
    request gets the answer computed without the cache; the damaged blocks read are removed."""
    from ucm.integration.vllm.llm import ucm_transfer_config
    from ucm.store.block_format import read_header

    whole = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(
        tmp_path, blend_ratio=0.15, blend_options=STORE_ALL, layerwise=False), disable_log_stats=False)
    first, reordered = prompts(blend_llm, seed=347)
    before = set(block_files(store_dir))
    for engine in (blend_llm, whole):
        run(engine, first)
        forget_local_prefix_cache(engine)
    for selection in ("query", "hkvd"):
        got = run(blend_llm, reordered, selection=selection, exact_prefix=False)
        assert got.report["blended"], got.report
        assert_same(got, run(whole, reordered, selection=selection, exact_prefix=False))
        forget_local_prefix_cache(blend_llm)
        forget_local_prefix_cache(whole)

    plain = run(blend_llm, reordered, disable=True, exact_prefix=False)
    forget_local_prefix_cache(blend_llm)
    wait_until_stable(store_dir)
    # This test's blocks of KV (not records): the other tests' blocks are left as they are.
    blocks = [p for p in block_files(store_dir) if p not in before and read_header(str(p)).segments]
    assert blocks
    for path in blocks:  # one byte of every block's last layer
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    got = run(blend_llm, reordered, exact_prefix=False)  # every chunk block read layer-wise
    # Read whole before the forward, the damaged blocks would be left out and the others blended.
    assert got.report.get("fallback") == "blend_error", got.report
    assert_same(got, plain, tol=1e-3)
    assert sum(p.exists() for p in blocks) < len(blocks)
