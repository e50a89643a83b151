"""benchmarks/admission_sim.py's replay: the connector's admission rule over a synthetic stream."""

from types import SimpleNamespace

from benchmark_scripts import load_script


def _stream(passages_per_request):
    return [SimpleNamespace(passages=tuple(p)) for p in passages_per_request]


def test_a_cold_start_and_the_evidence_store_then_a_new_passage_is_only_sighted():
    sim = load_script("admission_sim")
    blocks = {p: 5 for p in range(100)}
    fresh = _stream(range(10 * j, 10 * j + 10) for j in range(8))
    out = sim.replay(fresh, blocks, evidence=2, lag=4, cold=4)
    assert out["written_all"] == 6 * 50 + 1  # 4 cold requests and 2 of evidence (and the shared block once)
    before = sim.replay(fresh, blocks, evidence=4, lag=4, cold=4, warm_only=False)
    assert before["written_all"] == 4 * 50 + 1  # the rule before: the cold lookups were its evidence


def test_a_repeated_prompt_is_found_once_its_first_request_finished():
    sim = load_script("admission_sim")
    blocks = {p: 5 for p in range(10)}
    out = sim.replay(_stream([range(10)] * 8), blocks, evidence=2, lag=1, cold=1)
    assert out["found"] == 7 * 51 and out["written_all"] == 51
