"""benchmarks/rag_traffic.py: the request stream (Zipf draw, shuffle, noise, fresh mode) and its arguments."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rt():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling _serving.py
    try:
        spec = importlib.util.spec_from_file_location("rag_traffic", BENCHMARKS / "rag_traffic.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["rag_traffic"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def corpus(num_questions=20, passages=5):
    """Question q holds passage ids q * passages .. q * passages + passages - 1."""
    return [list(range(q * passages, (q + 1) * passages)) for q in range(num_questions)]


def test_stream_is_deterministic_in_the_seed(rt):
    qs = corpus()
    assert rt.make_stream(qs, 50, seed=3) == rt.make_stream(qs, 50, seed=3)
    assert rt.make_stream(qs, 50, seed=3) != rt.make_stream(qs, 50, seed=4)
    assert rt.make_stream(qs, 10, seed=3, fresh=True) == rt.make_stream(qs, 10, seed=3, fresh=True)


def test_zipf_draws_favour_low_ranks(rt):
    counts = Counter(r.question for r in rt.make_stream(corpus(), 4000, zipf_a=1.1, noise=0))
    assert counts[0] > counts[1] > counts[4] > counts[19]
    assert counts[0] / 4000 == pytest.approx(1 / sum(rt.zipf_weights(20, 1.1)), rel=0.15)
    flat = Counter(r.question for r in rt.make_stream(corpus(), 4000, zipf_a=0.0, noise=0))
    assert max(flat.values()) < 2 * min(flat.values())


def test_passages_are_shuffled_and_all_kept_without_noise(rt):
    qs = corpus()
    stream = rt.make_stream(qs, 200, noise=0)
    assert all(sorted(r.passages) == qs[r.question] and r.noise == () for r in stream)
    assert any(list(r.passages) != qs[r.question] for r in stream)


@pytest.mark.parametrize("noise", [1, 2, 4])
def test_noise_replaces_exactly_n_passages_by_other_questions_passages(rt, noise):
    qs = corpus()
    for r in rt.make_stream(qs, 200, noise=noise, seed=1):
        own = set(qs[r.question])
        assert len(r.passages) == len(own) and len(set(r.passages)) == len(own)
        assert len(r.noise) == noise
        foreign = [i for i, p in enumerate(r.passages) if p not in own]
        assert foreign == list(r.noise)
        assert all(any(r.passages[i] in qs[j] for j in range(len(qs)) if j != r.question) for i in foreign)


def test_noise_positions_vary(rt):
    positions = {r.noise for r in rt.make_stream(corpus(), 100, noise=2)}
    assert len(positions) > 5


def test_fresh_mode_never_repeats_a_passage(rt):
    qs = corpus(num_questions=rt.fresh_questions_needed(12, 2, 5), passages=5)
    stream = rt.make_stream(qs, 12, noise=2, fresh=True)
    sent = [p for r in stream for p in r.passages]
    assert len(stream) == 12 and len(sent) == len(set(sent)) == 12 * 5
    for r in stream:
        assert len(r.noise) == 2 and sum(p not in qs[r.question] for p in r.passages) == 2


def test_fresh_mode_handles_passages_shared_between_questions(rt):
    examples = [SimpleNamespace(passages=tuple(p)) for p in ("abc", "cde", "fgh", "ijk")]
    pool, qs = rt.passage_pool(examples)
    assert pool == list("abcdefghijk") and qs[1] == [2, 3, 4]
    stream = rt.make_stream(qs, 2, noise=0, fresh=True)
    sent = [p for r in stream for p in r.passages]
    assert len(sent) == len(set(sent)) and [r.question for r in stream] == [0, 2]


def test_fresh_mode_says_when_the_corpus_is_too_small(rt):
    with pytest.raises(ValueError, match="too few"):
        rt.make_stream(corpus(num_questions=5), 5, noise=2, fresh=True)


def test_arrival_times_are_poisson(rt):
    times = rt.arrival_times(2000, rate=4.0, seed=1)
    assert times == sorted(times) and times == rt.arrival_times(2000, rate=4.0, seed=1)
    assert 2000 / times[-1] == pytest.approx(4.0, rel=0.1)


def test_high_hit_requests_and_summary(rt):
    records = [{"i": 0, "ttft_s": 1.0, "chunk_blocks": 10, "chunk_hit_blocks": 8, "blended": True, "prompt_tokens": 100,
                "cached_tokens": 0},
               {"i": 1, "ttft_s": 3.0, "chunk_blocks": 10, "chunk_hit_blocks": 7, "blended": True, "prompt_tokens": 100,
                "cached_tokens": 50},
               {"i": 2, "ttft_s": 5.0, "chunk_blocks": 0, "chunk_hit_blocks": 0, "blended": False, "prompt_tokens": 100,
                "cached_tokens": 0}]
    assert rt.high_hit_requests(records) == {0}
    s = rt.summarize(records, wall_s=2.0, high_hit={0})
    assert s["requests_per_s"] == 1.5 and s["ttft_p50_s"] == 3.0 and s["high_hit_ttft_p50_s"] == 1.0
    assert s["chunk_hit_rate"] == 0.75 and s["blended_share"] == pytest.approx(2 / 3)
    assert s["vllm_cached_share"] == pytest.approx(50 / 300)
    assert rt.summarize(records, 2.0, None)["high_hit_ttft_p50_s"] is None


def test_argument_defaults(rt):
    args = rt.parse_args([])
    assert (args.questions, args.zipf, args.noise, args.concurrency, args.rates) == (50, 1.1, 2, [2], None)
    assert args.servers == ["plain", "blend"] and args.max_tokens == 8
    assert not args.fresh and not args.index and args.capacity_gb is None
    assert Path(args.out).parent != BENCHMARKS / "results"  # a scratch path unless --out says otherwise
    args = rt.parse_args(["--concurrency", "1,4", "--rates", "0.5,1", "--servers", "blend", "--capacity-gb", "2"])
    assert (args.concurrency, args.rates, args.servers, args.capacity_gb) == ([1, 4], [0.5, 1.0], ["blend"], 2.0)
    with pytest.raises(SystemExit):
        rt.parse_args(["--servers", "plain,lmcache"])


def test_help_shows_defaults(rt, capsys):
    with pytest.raises(SystemExit):
        rt.parse_args(["--help"])
    assert "(default: 1.1)" in capsys.readouterr().out
