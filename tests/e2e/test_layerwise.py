"""Layer-wise loading on the real engine (`use_layerwise: true`): a Blend step's chunk KV read in
layer groups while its forward runs gives the answers of the whole loads, and blocks whose later
layers fail to load send the step to vLLM's computation, nothing of it stored."""

from __future__ import annotations

from pathlib import Path

from blend_helpers import STORE_ALL, assert_same, forget_local_prefix_cache, prompts, run


def test_layerwise_loads_give_the_whole_loads_answers_and_late_faults_fall_back(model_dir, tmp_path, engine_factory,
                                                                                 blend_llm):
    """The same KV lands before each layer reads it: the default rule and HKVD give the
    log-probabilities of the engine that loads whole blocks before the forward (`blend_llm`). Then
    every stored block is damaged in its last layer: the first group's reads pass, the last
    group's fail, the step's Blend forward falls back, and the request gets the answer computed
    without the cache; the damaged blocks read are removed."""
    from ucm.integration.vllm.connector.stats import ucm_counters
    from ucm.integration.vllm.llm import ucm_transfer_config
    from ucm.store.block_format import read_header

    llm = engine_factory(model_dir, kv_transfer_config=ucm_transfer_config(
        tmp_path, blend_ratio=0.15, blend_options=STORE_ALL, layerwise=True), disable_log_stats=False)
    first, reordered = prompts(llm, seed=347)
    for engine in (llm, blend_llm):
        run(engine, first)
        forget_local_prefix_cache(engine)
    for selection in ("query", "hkvd"):
        got = run(llm, reordered, selection=selection, exact_prefix=False)
        assert got.report["blended"], got.report
        assert_same(got, run(blend_llm, reordered, selection=selection, exact_prefix=False))
        forget_local_prefix_cache(llm)
        forget_local_prefix_cache(blend_llm)
    assert ucm_counters().get("layerwise_wait_seconds", 0) > 0  # the forward waited for later layers' reads

    plain = run(llm, reordered, disable=True, exact_prefix=False)
    forget_local_prefix_cache(llm)
    blocks = [p for p in sorted(Path(tmp_path).rglob("*.kvb")) if read_header(str(p)).segments]  # KV, not records
    for path in blocks:  # one byte of every block's last layer
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    got = run(llm, reordered, exact_prefix=False)  # every stored block a chunk block, read layer-wise
    assert got.report.get("fallback") == "blend_error", got.report
    assert_same(got, plain, tol=1e-3)
    assert sum(p.exists() for p in blocks) < len(blocks)
