"""benchmarks/rag_traffic.py: the request stream (Zipf draw, shuffle, noise, fresh mode), its arguments,
and the routing over --instances (round robin, passages first seen on another instance, core binding)."""

import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmark_scripts import load_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rt():
    return load_script("rag_traffic")


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
    assert s["answer_f1"] is None  # runs recorded before answers were scored
    for r, f1 in zip(records, (1.0, 0.5, 0.0)):
        r["f1"] = f1
    assert rt.summarize(records, 2.0, None)["answer_f1"] == 0.5


def test_answers_are_scored_by_their_first_sentence(rt):
    assert rt.answer_f1(" Paris. It is the capital", ("Paris",)) == 1.0
    assert rt.answer_f1(" the city of Paris", ("Lyon", "Paris")) == 0.5  # "city of paris": articles go


def test_alone_picks_spread_over_the_high_hit_requests(rt):
    records = [{"i": i, "chunk_blocks": 10, "chunk_hit_blocks": 9 if i % 2 else 1} for i in range(20)]
    assert rt.alone_picks(records, 3) == [1, 7, 13]
    assert rt.alone_picks(records, 50) == list(range(1, 20, 2))
    assert rt.alone_picks(records, 0) == [] and rt.alone_picks(records[:1], 4) == []


def test_alone_summary_sets_stream_against_alone(rt):
    records = [{"i": i, "ttft_s": t, "chunk_blocks": 10, "chunk_hit_blocks": 8} for i, t in enumerate([8.0, 3.0, 6.0, 9.0])]
    alone = [{"i": 0, "ttft_s": 2.0}, {"i": 2, "ttft_s": 3.0}, {"i": 3, "ttft_s": 3.0}]
    alone = [{**a, "chunk_blocks": 10, "chunk_hit_blocks": 10} for a in alone]
    s = rt.alone_summary(records, alone)
    assert (s["alone_chunk_hit_rate"], s["alone_stream_chunk_hit_rate"]) == (1.0, 0.8)
    assert s["alone_requests"] == 3 and s["alone_ttft_p50_s"] == 3.0 and s["alone_stream_ttft_p50_s"] == 8.0
    assert s["high_hit_vs_alone"] == 3.0  # ratios 4, 2, 3
    assert rt.alone_summary(records, None) == {} and rt.alone_summary(records, []) == {}


def test_same_misses_makes_exactly_the_missed_chunks_new(rt):
    from ucm.sparse.blend.chunking import split_by_lengths
    from ucm.sparse.blend.hashing import BlockHasher
    from ucm.sparse.blend.plan import chunk_blocks

    lengths = [5, 12, 9, 4]  # system, three passages (the question follows)
    tokens = [100 + t % 7 for t in range(sum(lengths) + 6)]
    hits = [[5, 3, 3], [17, 3, 0], [26, 1, 1]]  # the passage at 17 missed in the stream; the rest hit
    same, same_lengths = rt.with_same_misses((tokens, lengths), hits, seed=3)
    assert same_lengths == lengths and len(same) == len(tokens)
    assert [i for i, (a, b) in enumerate(zip(tokens, same)) if a != b] == [17]  # one token, the chunk's first
    hasher = BlockHasher.from_seed("sha256", 4, "test")
    layout = split_by_lengths(len(tokens), lengths)
    stored = {h for h, _, _ in chunk_blocks(layout, tokens, hasher)}
    # Every block of that chunk is new, every other block is as it was.
    assert all((h not in stored) == (c == 17) for h, c, _ in chunk_blocks(layout, same, hasher))
    assert rt.with_same_misses((tokens, lengths), [[17, 3, 1]], seed=3)[0] == tokens  # hit in part: kept


def test_alone_summary_names_its_variant(rt):
    records = [{"i": 0, "ttft_s": 8.0, "chunk_blocks": 10, "chunk_hit_blocks": 8}]
    s = rt.alone_summary(records, [{"i": 0, "ttft_s": 4.0, "chunk_blocks": 10, "chunk_hit_blocks": 8}],
                         "alone_same_misses")
    assert s["high_hit_vs_alone_same_misses"] == 2.0 and s["alone_same_misses_chunk_hit_rate"] == 0.8


def test_argument_defaults(rt):
    args = rt.parse_args([])
    assert (args.questions, args.zipf, args.noise, args.concurrency, args.rates) == (50, 1.1, 2, [2], None)
    assert args.servers == ["plain", "blend"] and args.max_tokens == 8 and args.instances == 1 and args.alone == 8
    assert not args.fresh and not args.index and args.capacity_gb is None and args.warmup == 0
    assert Path(args.out).parent != BENCHMARKS / "results"  # a scratch path unless --out says otherwise
    args = rt.parse_args(["--concurrency", "1,4", "--rates", "0.5,1", "--servers", "blend", "--capacity-gb", "2"])
    assert (args.concurrency, args.rates, args.servers, args.capacity_gb) == ([1, 4], [0.5, 1.0], ["blend"], 2.0)
    with pytest.raises(SystemExit):
        rt.parse_args(["--servers", "plain,lmcache"])
    assert rt.parse_args(["--instances", "2"]).instances == 2
    with pytest.raises(SystemExit):
        rt.parse_args(["--instances", "0"])


def test_help_shows_defaults(rt, capsys):
    with pytest.raises(SystemExit):
        rt.parse_args(["--help"])
    assert "(default: 1.1)" in capsys.readouterr().out


def test_the_stream_is_pinned(rt):
    """The stream of a seed never changes (the same requests with --instances 1 as before it existed)."""
    R = rt.Request
    assert rt.make_stream(corpus(), 3, seed=0) == [R(10, (53, 33, 51, 52, 70), (1, 4)),
                                                   R(7, (69, 36, 17, 38, 39), (0, 2)), R(1, (7, 8, 98, 14, 6), (2, 3))]


def test_routing_is_round_robin(rt):
    assert rt.routing(7, 1) == [0] * 7
    assert rt.routing(7, 2) == [0, 1, 0, 1, 0, 1, 0]
    assert rt.routing(7, 3) == [0, 1, 2, 0, 1, 2, 0]
    assert rt.routing(0, 2) == []


def test_passages_first_seen_elsewhere(rt):
    requests = [(1, 2), (2, 3), (1, 2), (1, 4), (3, 5), (5, 5)]
    # to:        0       1       0       1       0       1
    # request 1: 2 was sent to 0 only -> 1; request 2: 1, 2 sent to 0 before -> 0; request 3: 1 only to 0 -> 1;
    # request 4: 3 sent to 1 only -> 1 (5 new); request 5: 5 sent to 0 only, counted once -> 1
    assert rt.passages_first_seen_elsewhere(requests, rt.routing(6, 2)) == [0, 1, 0, 1, 1, 1]
    assert rt.passages_first_seen_elsewhere(requests, rt.routing(6, 1)) == [0] * 6  # one instance: never
    # a passage sent to both instances is no longer "elsewhere" for either
    assert rt.passages_first_seen_elsewhere([(7,), (7,), (7,), (7,)], [0, 1, 0, 1]) == [0, 1, 0, 0]
    with pytest.raises(ValueError):
        rt.passages_first_seen_elsewhere(requests, [0, 1])


def test_elsewhere_counts_include_the_index_requests(rt):
    R = rt.Request
    stream = [R(0, (1, 2)), R(1, (2, 3)), R(0, (1, 2))]
    assert rt.stream_passages(stream) == [1, 2, 3]
    assert rt.elsewhere_counts(stream, 2, index=False) == [0, 1, 0]
    # --index first: 1 -> instance 0, 2 -> 1, 3 -> 0; then the stream from instance 0 again:
    # (1, 2) -> 0: 2 only on 1; (2, 3) -> 1: 3 only on 0; (1, 2) -> 0: both seen there
    assert rt.elsewhere_counts(stream, 2, index=True) == [1, 1, 0]
    assert rt.elsewhere_counts(stream, 1, index=True) == [0, 0, 0]


def test_core_binding(rt):
    assert rt.core_binding(1, {0, 1}) == [{}]  # one instance: vLLM's automatic binding, as before
    assert rt.core_binding(2, {1, 0}) == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in rt.core_binding(3, {4, 6})] == ["4", "6", "4"]


def _rec(i, instance, blocks, hits, elsewhere, cached=0):
    return {"i": i, "ttft_s": 1.0, "chunk_blocks": blocks, "chunk_hit_blocks": hits, "blended": bool(hits),
            "prompt_tokens": 100, "cached_tokens": cached, "instance": instance,
            "passages_first_seen_elsewhere": elsewhere}


def test_instance_summary(rt):
    records = [_rec(0, 0, 10, 0, 0), _rec(1, 1, 10, 4, 2, cached=50), _rec(2, 0, 10, 10, 0), _rec(3, 1, 10, 6, 1)]
    s = rt.summarize(records, wall_s=1.0, high_hit=None, instances=2)
    assert s["instances"] == 2 and s["chunk_hit_rate"] == 0.5
    assert s["chunk_hit_rate_per_instance"] == [0.5, 0.5]
    assert s["vllm_cached_share_per_instance"] == [0.0, 0.25]
    assert s["passages_first_seen_elsewhere"] == 3 and s["requests_first_seen_elsewhere"] == 2
    assert s["first_seen_elsewhere_chunk_hit_rate"] == 0.5 and s["other_requests_chunk_hit_rate"] == 0.5
    three = rt.summarize(records, 1.0, None, instances=3)  # an instance without requests
    assert three["chunk_hit_rate_per_instance"][2] is None and three["vllm_cached_share_per_instance"][2] is None
    plain = rt.summarize([_rec(0, 0, 0, 0, 1)], 1.0, None, instances=2)
    assert plain["first_seen_elsewhere_chunk_hit_rate"] is None and plain["chunk_hit_rate_per_instance"] == [None, None]


def test_one_instance_keeps_the_summary_keys(rt):
    old_keys = {"requests", "wall_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "high_hit_requests",
                "high_hit_ttft_p50_s", "high_hit_ttft_p90_s", "chunk_hit_rate", "blended_share", "vllm_cached_share"}
    new_keys = ("instance", "passages_first_seen_elsewhere")
    records = [{k: v for k, v in _rec(0, 0, 10, 5, 0).items() if k not in new_keys}]
    s = rt.summarize(records, 1.0, None)  # records written before --instances existed
    assert old_keys <= set(s) and s["instances"] == 1 and s["chunk_hit_rate_per_instance"] == [0.5]
    assert s["passages_first_seen_elsewhere"] == 0 and s["first_seen_elsewhere_chunk_hit_rate"] is None


class _Client:
    """Stands in for an httpx client: answers /v1/completions like vLLM and keeps the prompts it got."""

    def __init__(self):
        self.prompts = []

    async def post(self, path, json):
        self.prompts.append(json["prompt"])
        await asyncio.sleep(0.001 * (json["prompt"][0] % 3))  # answers out of order
        body = {"usage": {"prompt_tokens": 1}, "choices": [{"text": ""}], "metrics": {}}
        return SimpleNamespace(raise_for_status=lambda: None, json=lambda: body)


@pytest.mark.parametrize("level", [("concurrency", 2), ("concurrency", 3), ("rate", 500.0)])
def test_run_stream_sends_request_k_to_instance_k_mod_n(rt, level):
    prompts = [([k], [1]) for k in range(9)]
    clients, records = [_Client(), _Client()], []
    asyncio.run(rt.run_stream(clients, "m", prompts, "salt", False, 1, level, 0, records.append))
    assert sorted(clients[0].prompts) == [[k] for k in range(0, 9, 2)]
    assert sorted(clients[1].prompts) == [[k] for k in range(1, 9, 2)]
    assert sorted(r["i"] for r in records) == list(range(9))


def test_warm_up_sends_each_instance_the_first_prompts_under_a_tenant_of_their_own(rt):
    prompts = [([k], [1]) for k in range(3)]
    clients = [_Client(), _Client()]
    bodies = []
    for c in clients:
        c.post = lambda path, json, _post=c.post: bodies.append(json) or _post(path, json)
    asyncio.run(rt.warm_up(clients, "m", prompts, 2, True))
    assert [c.prompts for c in clients] == [[[0], [1]], [[0], [1]]]
    assert {b["cache_salt"] for b in bodies} == {f"{rt.TENANT}-warmup"} and all("kv_transfer_params" in b for b in bodies)
    asyncio.run(rt.warm_up(clients, "m", prompts, 0, True))
    assert len(bodies) == 4


def test_finish_and_table_with_two_instances(rt, capsys):
    records = [_rec(0, 0, 10, 0, 0), _rec(1, 1, 10, 4, 2)]
    store = {"dump_bytes": 0, "load_bytes": 0, "fallbacks": {}, "store_bytes": 0, "store_blocks": 0,
             "dumped_not_in_store": 0}
    results = {"config": {"instances": 2}, "runs": [
        {"server": s, "load": "c=2", "records": records, "wall_s": 1.0, "summary": dict(store)} for s in rt.SERVERS]}
    rt.finish(results)
    assert results["runs"][1]["summary"]["chunk_hit_rate_per_instance"] == [0.0, 0.4]
    rt.print_table(results)
    out = capsys.readouterr().out
    assert "blend c=2: chunk hits per instance 0% / 40%" in out and "2 passages first seen on another instance" in out


def test_counters_are_read_from_prometheus_text_summed_over_engines(rt):
    """The servers' /metrics text, as prometheus_client writes it: each connector counter summed
    over its label sets (one per engine); other families and the _created samples are ignored."""
    from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, generate_latest

    registry = CollectorRegistry()
    loads = PromCounter("vllm:ucm_load_seconds", "seconds", ["engine"], registry=registry)
    loads.labels("0").inc(1.25)
    loads.labels("1").inc(0.5)
    PromCounter("vllm:ucm_loaded_blocks", "blocks", registry=registry).inc(7)
    PromCounter("vllm:prompt_tokens", "not ours", registry=registry).inc(100)
    Gauge("vllm:ucm_not_a_counter", "gauge", registry=registry).set(3)
    text = generate_latest(registry).decode()
    assert sys.modules["_serving"].parse_counters(text) == {"load_seconds": 1.75, "loaded_blocks": 7.0}


class _LogprobClient:
    """Answers like vLLM's completions endpoint with logprobs and return_tokens_as_token_ids."""

    def __init__(self, top):
        self.top, self.bodies = top, []

    async def post(self, path, json):
        self.bodies.append(json)
        body = {"usage": {"prompt_tokens": 1}, "metrics": {}, "choices": [{"text": "a", "logprobs": {
            "top_logprobs": [{f"token_id:{t}": lp for t, lp in self.top.items()}, {"token_id:9": -0.1}]}}]}
        return SimpleNamespace(raise_for_status=lambda: None, json=lambda: body)


def test_send_records_the_first_tokens_top_k_by_token_id_only_when_asked(rt):
    client = _LogprobClient({5: -0.2, 7: -1.8})
    rec = asyncio.run(rt.send(client, "m", ([1, 2], [2]), "salt", False, 2, logprobs=2))
    assert client.bodies[0]["logprobs"] == 2 and client.bodies[0]["return_tokens_as_token_ids"] is True
    assert rec["first_logprobs"] == [[5, -0.2], [7, -1.8]]
    rec = asyncio.run(rt.send(client, "m", ([1, 2], [2]), "salt", False, 2))
    assert "logprobs" not in client.bodies[1] and "first_logprobs" not in rec


def test_kl_summary_pairs_requests_by_index_and_splits_out_the_blended(rt):
    import math
    same = [[1, math.log(0.7)], [2, math.log(0.2)]]
    other = [[1, math.log(0.2)], [2, math.log(0.7)]]
    plain = [{"i": 0, "first_logprobs": same}, {"i": 1, "first_logprobs": same}, {"i": 2}]
    blend = [{"i": 1, "blended": True, "first_logprobs": other}, {"i": 0, "blended": False, "first_logprobs": same},
             {"i": 2, "blended": True, "first_logprobs": other}]  # request 2: plain recorded no list
    s = rt.kl_summary(blend, plain)
    expected = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert s["kl_requests"] == 2 and s["kl_blended_requests"] == 1
    assert s["first_token_kl_blended_mean"] == pytest.approx(expected)
    assert s["first_token_kl_mean"] == pytest.approx(expected / 2)
    assert rt.kl_summary(blend, [{"i": 0}]) == {}


def test_store_summary_takes_the_runs_deltas_and_counts_the_store_files(rt, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.kvb").write_bytes(b"12345")
    before = {"dump_bytes": 100.0, "dumped_blocks": 1.0, "blend_fallbacks_few_hits": 2.0}
    after = {"dump_bytes": 600.0, "dumped_blocks": 4.0, "blend_fallbacks_few_hits": 5.0, "blend_steps_over_cap": 0.0}
    s = rt.store_summary(before, after, str(tmp_path))
    assert s["dump_bytes"] == 500 and s["fallbacks"] == {"blend_fallbacks_few_hits": 3}
    assert s["blend_steps_over_cap"] == 0 and s["store_blocks"] == 1 and s["store_bytes"] == 5
    assert s["dumped_not_in_store"] == 3


def test_mount_specs_parse_and_bad_ones_name_the_problem(rt):
    from _mount_schedule import MountSchedule

    s = MountSchedule.parse("hang=open+read+write@60/300; latency_ms=5")
    assert (s.window, s.at, s.duration, s.steady) == ({"hang": ["open", "read", "write"]}, 60.0, 300.0,
                                                      {"latency_ms": 5.0})
    assert MountSchedule.parse("").window == {} and rt.parse_args(["--mount", "latency_ms=5"]).mount == "latency_ms=5"
    with pytest.raises(ValueError, match="unknown kinds"):
        MountSchedule.parse("hang=open+nfs@1/2")
    with pytest.raises(ValueError, match="expected latency_ms"):
        MountSchedule.parse("latency=5")


def test_the_schedule_sets_the_mount_at_its_times(rt):
    from _mount_schedule import MountSchedule

    class Mount:
        def __init__(self):
            self.states = []

        def set(self, **state):
            self.states.append(state)

    async def run(mount, events):
        MountSchedule.parse("eio=read@0.05/0.05;latency_ms=2").start(mount, events)
        await asyncio.sleep(0.3)

    mount, events = Mount(), []
    asyncio.run(run(mount, events))
    assert mount.states == [{"latency_ms": 2.0}, {"latency_ms": 2.0, "eio": ["read"]}, {"latency_ms": 2.0}]
    assert [t for t, _ in events] == sorted(t for t, _ in events) and len(events) == 3


def test_window_summary_counts_what_ended_in_the_window_and_when_blending_resumed(rt):
    from _mount_schedule import window_summary

    records = [{"start_s": 0, "end_s": 50, "blended": True}, {"start_s": 55, "end_s": 100, "blended": False},
               {"start_s": 90, "end_s": 200, "blended": False}, {"start_s": 161, "end_s": 170, "blended": False},
               {"start_s": 175, "end_s": 190, "blended": True}]
    s = window_summary(records, 60, 100)
    assert s["window_requests_per_s"] == pytest.approx(1 / 100)  # the one that ended at 100
    assert s["after_window_requests_per_s"] == pytest.approx(3 / 60)
    assert s["first_blend_after_release_s"] == 15
