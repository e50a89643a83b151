"""Data set loaders, generated QA set, prompt building, F1 and the Blend evaluation summary."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from ucm.eval.modes import FULL_PREFILL, modes_for, parse_ratios, parse_selections
from ucm.eval.engine import add_run_args, check_run_args, run_store, store_capacity_gb
from ucm.eval.measure import indexing_prompts, Measurement
from ucm.eval.summary import (format_cache_table, format_counters, format_interval_table, format_table, format_tables,
                              summarize, unexpected_reports)
from ucm.eval.datasets import DatasetError, generate_synthetic, load_dataset
from ucm.eval.metrics import best_f1, bootstrap_ci, paired_speedup, short_answer, token_f1
from ucm.eval.prompts import ChunkedPrompt, build_prompt
from ucm.store.config import GB


def test_f1_and_short_answer():
    assert token_f1("The Eiffel Tower", "eiffel tower") == 1.0
    assert token_f1("Paris", "London") == 0.0
    assert abs(token_f1("in Paris France", "Paris") - 0.5) < 1e-9
    assert best_f1("Orvale", ["Brackenford", "Orvale"]) == 1.0
    assert short_answer("\nbookbinder. She is a skilled bookbinder.\nmore") == "bookbinder"
    assert short_answer("3.5 meters") == "3.5 meters"


def test_generated_answer_is_stated_in_exactly_one_passage():
    for ex in generate_synthetic(num_examples=20, passages_per_example=6, passage_words=120, seed=3):
        holders = [p for p in ex.passages if ex.answers[0] in p]
        assert len(holders) == 1, ex.question
        name = ex.question.split(" of ")[-1].rstrip("?") if "job" in ex.question else ex.question.split(" was ")[1].split(" born")[0]
        assert name in holders[0]
        assert ex.answer_prefix.startswith(name)


def test_generated_set_is_deterministic():
    assert generate_synthetic(num_examples=3, seed=7) == generate_synthetic(num_examples=3, seed=7)
    assert generate_synthetic(num_examples=3, seed=7) != generate_synthetic(num_examples=3, seed=8)


def test_cacheblend_json_loader(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"ctxs": [{"title": "T", "text": "body"}, {"title": "", "text": "x"}],
                                 "question": "q?", "answers": ["a", "b"]}]))
    (ex,) = load_dataset(path)
    assert ex.passages == ("T\nbody", "x") and ex.question == "q?" and ex.answers == ("a", "b")


def test_longbench_jsonl_loader(tmp_path):
    path = tmp_path / "d.jsonl"
    ctx = "\n".join(f"paragraph {i} " + "word " * 50 for i in range(20))
    path.write_text(json.dumps({"context": ctx, "input": "q?", "answers": ["a"]}) + "\n")
    (ex,) = load_dataset(path)
    assert len(ex.passages) > 1 and "".join(ex.passages).replace("\n", "") == ctx.replace("\n", "")


@pytest.mark.parametrize("content,match", [
    ("{not json", "not a readable JSON"),
    ('{"a": 1}', "expected a JSON list"),
    ('[{"ctxs": []}]', "item 0 lacks"),
])
def test_bad_files_name_the_problem(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_dataset(path)
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "missing.json")


def test_musique_loads(musique_path):
    examples = load_dataset(musique_path)
    assert len(examples) == 100 and all(len(e.passages) == 10 and e.answers for e in examples)


def test_prompt_chunks_are_position_independent(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ex = generate_synthetic(num_examples=1, passages_per_example=3, passage_words=60)[0]
    a = build_prompt(tok, ex, 2)
    b = build_prompt(tok, ex, 2, order=[2, 0, 1])
    assert len(a.chunk_lengths) == 4 and all(
        a.token_ids[sum(a.chunk_lengths[:i + 1]) - 1] == 2 for i in range(4))
    # chunk 3 of prompt a (passage 2) is chunk 1 of prompt b, token for token
    start_a, start_b = sum(a.chunk_lengths[:3]), a.chunk_lengths[0]
    n = a.chunk_lengths[3]
    assert a.token_ids[start_a:start_a + n] == b.token_ids[start_b:start_b + n]


# ---- ucm.eval: modes, indexing prompts and the summary (no engine) --------------------------------


def test_modes_and_ratios():
    modes = modes_for([0.15, 0.0, 0.15, 1.0])
    assert [m.name for m in modes] == ["full prefill", "blend 0.15", "full reuse", "blend 1"]
    assert modes[0] is FULL_PREFILL and modes[0].is_full and modes[2].ratio == 0.0
    assert parse_ratios("0, 0.05,1") == [0.0, 0.05, 1.0]
    for bad in ("", "x", "1.5", "-0.1"):
        with pytest.raises(ValueError):
            parse_ratios(bad)


def test_modes_per_selection_share_the_unranked_ratios():
    modes = modes_for([0.0, 0.15, 1.0], ["query", "hkvd"])
    assert [m.name for m in modes] == ["full prefill", "full reuse", "blend 0.15", "blend 1", "hkvd 0.15"]
    assert [m.selection for m in modes] == [None, None, "query", None, "hkvd"]
    assert parse_selections(" hkvd,query ") == ["hkvd", "query"]
    assert [m.name for m in modes_for([0.15], ["oracle"])] == ["full prefill", "oracle 0.15"]
    for bad in ("", "hkvd,random"):
        with pytest.raises(ValueError, match="selections"):
            parse_selections(bad)


def _run_parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_run_args(p, num_questions=1, passages=2, passage_words=10)
    return p


def test_store_is_capped_for_temporary_stores_only(tmp_path):
    """A long run must not fill the disk: a temporary store gets half the free space, a user's store no cap."""
    args = _run_parser().parse_args([])
    assert store_capacity_gb(args, str(tmp_path), temporary=True) == pytest.approx(
        shutil.disk_usage(tmp_path).free / 2 / GB, rel=0.05)
    assert store_capacity_gb(args, str(tmp_path), temporary=False) is None
    args = _run_parser().parse_args(["--store-capacity-gb", "3.5"])
    assert store_capacity_gb(args, str(tmp_path), temporary=True) == 3.5
    assert store_capacity_gb(args, str(tmp_path), temporary=False) == 3.5
    p = _run_parser()
    with pytest.raises(SystemExit):
        check_run_args(p, p.parse_args(["--store-capacity-gb", "0"]))


def test_skip_questions_runs_the_end_of_a_longer_run(tmp_path):
    """--skip-questions N: the questions a run of N + num-questions would end with (held-out questions
    of a generated set); a bad value ends the run before anything slow starts."""
    from ucm.eval.engine import examples_and_model

    def examples(*argv):
        args = _run_parser().parse_args(list(argv))
        args.dataset, args.model = None, "unused"
        return examples_and_model(args)[0]

    longer = examples("--num-questions", "5")
    assert examples("--num-questions", "2", "--skip-questions", "3") == longer[3:]
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"ctxs": [{"title": "T", "text": "body"}], "question": "q?", "answers": ["a"]}]))
    for argv, dataset in ((["--skip-questions", "-1"], None), (["--skip-questions", "1"], str(one))):
        args = _run_parser().parse_args(argv)
        args.dataset, args.model = dataset, "unused"
        with pytest.raises(SystemExit) as exc:
            examples_and_model(args)
        assert exc.value.code == 2


SIGTERM_SCRIPT = """
import argparse, os, signal, sys
from ucm.eval.engine import run_store
args = argparse.Namespace(store_dir=None, store_capacity_gb=None)
with run_store(args, "ucm-test-store-") as store:
    open(os.path.join(store.path, "block"), "wb").write(b"x" * 1024)
    print(store.path, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
"""


def test_a_terminated_run_removes_its_temporary_store():
    out = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT], capture_output=True, text=True, timeout=60)
    path = out.stdout.split("\n")[0]
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert path.startswith(tempfile.gettempdir()) and not os.path.exists(path)
    assert "removed the temporary store" in out.stdout


def test_a_given_store_dir_is_kept(tmp_path):
    args = argparse.Namespace(store_dir=str(tmp_path / "mine"), store_capacity_gb=None)
    os.makedirs(args.store_dir)
    with run_store(args, "unused-") as store:
        assert store.path == args.store_dir and not store.temporary and store.capacity_gb is None
    assert os.path.isdir(args.store_dir)


def test_transfer_config_carries_the_store_cap(tmp_path):
    from ucm.integration.vllm.llm import ucm_transfer_config
    from ucm.store.config import NfsStoreConfig

    extra = ucm_transfer_config(tmp_path, 0.15, capacity_gb=2.0).kv_connector_extra_config
    store = NfsStoreConfig.from_dict(extra["ucm_connectors"][0]["ucm_connector_config"])
    assert store.capacity_bytes == 2 * GB and store.storage_backends
    extra = ucm_transfer_config(tmp_path).kv_connector_extra_config
    assert NfsStoreConfig.from_dict(extra["ucm_connectors"][0]["ucm_connector_config"]).capacity_bytes is None


def test_kv_shift_option_reaches_the_blend_config_and_bad_shares_are_refused(tmp_path):
    from ucm.config import KV_SHIFT_DEFAULT, UCMConfig
    from ucm.integration.vllm.llm import ucm_transfer_config

    def configured(kv_shift):
        extra = ucm_transfer_config(tmp_path, 0.15, kv_shift=kv_shift).kv_connector_extra_config
        return UCMConfig.from_extra_config(extra).sparse.kv_shift

    assert configured(None) == KV_SHIFT_DEFAULT and configured(0.5) == 0.5 and configured(0.0) == 0.0
    p = _run_parser()
    assert p.parse_args([]).kv_shift is None and p.parse_args(["--kv-shift", "0.5"]).kv_shift == 0.5
    with pytest.raises(SystemExit):
        check_run_args(p, p.parse_args(["--kv-shift", "1.5"]))


def test_indexing_prompts_are_system_plus_each_passage():
    prompt = ChunkedPrompt([1, 2, 10, 11, 2, 20, 2, 30, 31], [2, 3, 2])  # suffix 30, 31
    assert indexing_prompts(prompt) == [[1, 2, 10, 11, 2], [1, 2, 20, 2]]


def _m(q, mode, ratio, ttft, answer, gold_f1, report=None, vs_full=None, agree=None, counters=None):
    return Measurement(q, mode, ratio, 100, ttft, "metrics", answer, answer, gold_f1, vs_full, agree, report or {},
                       counters or {})


def test_summary_medians_speedup_quality_and_counters():
    hit = {"blended": True, "chunk_hit_tokens": 90, "chunk_hit_blocks": 3, "chunk_blocks": 3}
    counted = {"recomputed_tokens": 15, "reused_tokens": 75, "load_bytes": 2_500_000, "load_seconds": 0.03}
    rows = [
        _m(0, "full prefill", None, 4.0, "a", 1.0), _m(1, "full prefill", None, 6.0, "b", 0.0),
        _m(2, "full prefill", None, 5.0, "c", 1.0),
        _m(0, "blend 0.15", 0.15, 1.0, "a", 1.0, hit, 1.0, True, counted),
        _m(1, "blend 0.15", 0.15, 2.0, "x", 0.0, hit, 0.0, False, counted),
        _m(2, "blend 0.15", 0.15, 9.0, "c", 1.0, dict(hit, blended=False), 1.0, True),
    ]
    full, blend = summarize(rows, modes_for([0.15, 0.0]))  # no full-reuse rows: left out
    assert full.median_ttft_s == 5.0 and full.speedup == 1.0 and full.f1_vs_full is None and full.agree_pct is None
    assert blend.median_ttft_s == 2.0 and blend.mean_ttft_s == 4.0 and blend.speedup == 2.5
    assert blend.f1_gold == pytest.approx(2 / 3) and blend.f1_vs_full == pytest.approx(2 / 3)
    assert blend.agree_pct == pytest.approx(200 / 3)
    # Paired with full prefill question by question: 1-1, 0-0, 1-1.
    assert blend.f1_gold_delta == 0.0 and full.f1_gold_delta is None and full.f1_vs_full_ci is None
    lo, hi = blend.agree_pct_ci
    assert 0.0 <= lo < blend.agree_pct < hi <= 100.0
    intervals = format_interval_table([full, blend]).splitlines()
    assert len(intervals) == 3 and intervals[2].startswith("blend 0.15") and "67% (" in intervals[2]
    assert format_tables([full, blend]).count("mode ") == 3
    assert (blend.blended, blend.chunk_hit_tokens, blend.chunk_hit_blocks, blend.chunk_blocks) == (2, 270, 9, 9)
    table = format_table([full, blend]).splitlines()
    assert table[0].split()[:2] == ["mode", "ratio"] and set(table[1]) <= {"-", " "}
    assert "2.50x" in table[3] and "67%" in table[3]
    assert (blend.recomputed_tokens, blend.reused_tokens, blend.load_bytes) == (30, 150, 5_000_000)
    assert blend.recomputed_pct == pytest.approx(100 / 6) and full.recomputed_pct is None
    cache = format_cache_table([full, blend]).splitlines()
    assert "2/3" in cache[3] and "9/9" in cache[3] and "270" in cache[3]
    assert "30 (16.7%)" in cache[3] and "5.0" in cache[3] and " 20 " in cache[3]  # 60 ms over 3 requests
    lines = format_counters({"recomputed_tokens": 30, "load_bytes": 5e6}).splitlines()
    assert any(ln.split()[:2] == ["recomputed_tokens", "30"] for ln in lines)
    assert any(ln.split()[:2] == ["load_bytes", "5,000,000"] for ln in lines)
    problems = unexpected_reports(rows)
    assert len(problems) == 1 and "question 2 blend 0.15: not blended" in problems[0]
    no_report = [_m(0, "blend 0.15", 0.15, 1.0, "a", 1.0)]
    assert unexpected_reports(no_report) == ["question 0 blend 0.15: no connector report"]


def test_check_fits_warns_and_leaves_out_prompts_too_long():
    from types import SimpleNamespace

    from ucm.eval.measure import BlendEvaluator
    from ucm.eval.datasets import QAExample

    class Tok:  # one token per word
        def encode(self, text, add_special_tokens=False):
            return [5] * len(text.split())

        def convert_tokens_to_ids(self, token):
            return 2

    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=300))
    llm = SimpleNamespace(get_tokenizer=Tok, llm_engine=engine)
    short, mid, long = (QAExample(("w " * n,), "q?", ("a",)) for n in (50, 200, 400))
    ev = BlendEvaluator(llm, max_tokens=16, max_num_batched_tokens=150)
    kept, warnings = ev.check_fits([short, mid, long])
    assert [i for i, _ in kept] == [0, 1]
    assert len(warnings) == 2 and "question 1" in warnings[0] and "max_num_batched_tokens=150" in warnings[0]
    assert "question 2" in warnings[1] and "left out" in warnings[1]


def test_bootstrap_interval_covers_the_mean_and_narrows_with_more_questions():
    assert bootstrap_ci([1.0]) is None and bootstrap_ci([]) is None
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    few = [1.0, 0.0] * 10
    many = few * 10
    lo_few, hi_few = bootstrap_ci(few)
    lo_many, hi_many = bootstrap_ci(many)
    assert lo_few < 0.5 < hi_few and lo_many < 0.5 < hi_many
    assert hi_many - lo_many < (hi_few - lo_few) / 2  # ~1/sqrt(10) as wide
    assert bootstrap_ci(few) == (lo_few, hi_few)  # seeded


def test_mean_kl_is_zero_for_equal_and_positive_for_different_distributions():
    import torch

    from ucm.eval.measure import mean_kl

    p = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0)
    q = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, -1.0]), 0)
    assert mean_kl([p], [p]) == 0.0
    expected = float((p.exp() * (p - q)).sum())
    assert abs(mean_kl([p, p], [q, p]) - expected / 2) < 1e-6
    short = torch.tensor([0.0])  # a reference that knows one token: other tokens count as 0
    assert abs(mean_kl([short], [torch.log(torch.tensor([0.5, 0.5]))]) - torch.log(torch.tensor(2.0)).item()) < 1e-6


def test_pareto_modes_hold_every_rule_and_epic_k():
    from ucm.eval.modes import pareto_modes

    modes = pareto_modes([0, 0.15, 0.3, 1], ["query", "hkvd", "key_l1", "chunk_start"], [8, 32])
    names = [m.name for m in modes]
    assert names == ["full prefill", "full reuse", "blend 0.15", "blend 0.3", "hkvd 0.15", "hkvd 0.3",
                     "key_l1 0.15", "key_l1 0.3", "chunk_start 8", "chunk_start 32", "blend 1"]
    assert modes[8].chunk_start_tokens == 8 and modes[8].selection == "chunk_start"


def test_plus_chunk_start_repeats_the_ranked_modes_with_epic_rows():
    from ucm.eval.modes import modes_for, plus_chunk_start

    modes = modes_for([0, 0.15, 1], ["query", "hkvd"])
    extra = plus_chunk_start(modes, 16)
    assert [m.name for m in extra] == ["blend 0.15 +start 16", "hkvd 0.15 +start 16"]
    assert all(m.chunk_start_tokens == 16 and m.ratio == 0.15 for m in extra)
    assert plus_chunk_start(extra, 8) == []  # already combined
    with pytest.raises(ValueError, match="positive int"):
        plus_chunk_start(modes, 0)


def test_plus_kv_shift_repeats_the_ranked_modes_with_a_share_of_the_shift():
    from ucm.eval.modes import modes_for, plus_kv_shift

    modes = modes_for([0, 0.15, 1], ["query", "chunk_start"])
    assert [(m.name, m.kv_shift) for m in plus_kv_shift(modes)] == [("blend 0.15 +shift", 1.0)]
    half = plus_kv_shift(modes, 0.5)
    assert [(m.name, m.kv_shift) for m in half] == [("blend 0.15 +shift 0.5", 0.5)]
    assert [m.name for m in plus_kv_shift(modes, 0)] == ["blend 0.15 +shift 0"]  # none, whatever the default
    assert plus_kv_shift(half) == []  # already set
    with pytest.raises(ValueError, match="kv_shift share"):
        plus_kv_shift(modes, 1.5)


def test_plus_shift_sample_repeats_the_ranked_modes_with_a_sampled_shift():
    from ucm.eval.modes import modes_for, plus_shift_sample

    modes = modes_for([0, 0.15, 1], ["query", "chunk_start"])
    assert [(m.name, m.kv_shift, m.kv_shift_sample) for m in plus_shift_sample(modes, 0.03)] == [
        ("blend 0.15 +sample 0.03", 1.0, 0.03)]
    assert [m.name for m in plus_shift_sample(modes, 0.05, 0.5)] == ["blend 0.15 +sample 0.05 shift 0.5"]
    for bad in (0, 0.6):
        with pytest.raises(ValueError, match="kv_shift_sample"):
            plus_shift_sample(modes, bad)


def test_related_passages_are_the_most_similar_others():
    from ucm.eval.related import related_passages

    pool = ["the cat sat on the mat", "a cat on a mat", "stock markets fell today", "markets fell sharply today",
            "the cat sat on the mat"]
    assert related_passages(pool, 1) == [[1], [0], [3], [2], [1]]  # a copy of itself is not its context
    assert related_passages(pool, 0) == [[]] * 5
    with pytest.raises(ValueError, match="k must be >= 0"):
        related_passages(pool, -1)


def test_indexing_with_related_context_puts_it_between_system_and_passage():
    from types import SimpleNamespace

    from ucm.eval.measure import BlendEvaluator

    class Tok:  # one token per word, the word's length as its id
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

        def convert_tokens_to_ids(self, token):
            return 2

    sent = []

    def generate(prompts, params, use_tqdm=False):
        sent.extend(zip(prompts, params))
        return [SimpleNamespace(kv_transfer_params={}) for _ in prompts]

    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=300))
    llm = SimpleNamespace(get_tokenizer=Tok, llm_engine=engine, generate=generate)
    ev = BlendEvaluator(llm, related={"p1": ["r"]})
    prompt = ChunkedPrompt([1, 2, 10, 11, 2, 20, 2, 30, 31], [2, 3, 2])
    ev.index(prompt, ["p1", "p2"])
    ctx = ev.context_ids(["r"])
    assert ctx and sent[0][0]["prompt_token_ids"] == [1, 2] + ctx + [10, 11, 2]
    assert sent[0][1].extra_args["kv_transfer_params"]["ucm_chunk_lengths"] == [2, len(ctx), 3]
    assert sent[1][0]["prompt_token_ids"] == [1, 2, 20, 2]  # no related passage: as without context
    assert sent[1][1].extra_args["kv_transfer_params"]["ucm_chunk_lengths"] == [2, 2]


def test_top_k_kl_is_exact_on_whole_lists_and_a_lower_bound_on_top_k():
    import math
    import torch
    from ucm.eval.measure import mean_kl
    from ucm.eval.metrics import top_k_kl

    g = torch.Generator().manual_seed(0)
    p, q = (torch.log_softmax(2 * torch.randn(50, generator=g), 0) for _ in range(2))
    full = mean_kl([p], [q])
    as_dict = lambda x, k: dict(zip(*(v.tolist() for v in reversed(torch.topk(x, k)))))  # noqa: E731
    assert top_k_kl(as_dict(p, 50), as_dict(p, 50)) == 0.0
    assert top_k_kl(as_dict(p, 50), as_dict(q, 50)) == pytest.approx(full, rel=1e-6)
    for k in (1, 5, 20):
        assert 0.0 <= top_k_kl(as_dict(p, k), as_dict(q, k)) <= full + 1e-9
    # no token in both lists: one bin holds everything, and the bound says nothing
    assert top_k_kl({1: math.log(0.1)}, {2: math.log(0.5)}) == 0.0
    assert top_k_kl({1: math.log(0.1)}, {1: math.log(0.5)}) == pytest.approx(
        0.1 * math.log(0.1 / 0.5) + 0.9 * math.log(0.9 / 0.5))


def test_missed_passages_are_spread_over_the_prompt():
    from ucm.eval.measure import missed_passages

    assert missed_passages(10, 0) == []
    assert missed_passages(10, 2) == [2, 7]
    assert missed_passages(10, 5) == [1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="cannot leave 3 of 2"):
        missed_passages(2, 3)


def test_min_question_tokens_keeps_the_first_long_questions(tmp_path, model_dir):
    from transformers import AutoTokenizer

    from ucm.eval.engine import examples_and_model
    from ucm.eval.prompts import question_tokens

    long_q = "Which " + "very " * 40 + "long question is this?"
    items = [{"ctxs": [{"title": "T", "text": "body"}], "question": q, "answers": ["a"]}
             for q in ("short?", long_q + " one", "short again?", long_q + " two", long_q + " three")]
    path = tmp_path / "set.json"
    path.write_text(json.dumps(items))
    args = argparse.Namespace(dataset=str(path), num_questions=2, skip_questions=0, passages=10, passage_words=100,
                              model=str(model_dir), min_question_tokens=32)
    examples, model = examples_and_model(args)
    assert model == str(model_dir)
    assert [e.question for e in examples] == [long_q + " one", long_q + " two"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert question_tokens(tokenizer, examples[0]) > 32 >= question_tokens(tokenizer, _example("short?"))


def _example(question):
    from ucm.eval.datasets import QAExample

    return QAExample(("body",), question, ("a",))


def test_paired_speedup_is_the_geometric_mean_of_per_request_ratios_over_shared_requests():
    plain = {0: 4.0, 1: 9.0, 2: 1.0, 3: 5.0}
    blend = {0: 2.0, 1: 3.0, 2: 1.0, 9: 1.0}  # 3 only on plain, 9 only on blend: not paired
    mean, (lo, hi) = paired_speedup(plain, blend)
    assert mean == pytest.approx((2.0 * 3.0 * 1.0) ** (1 / 3))
    assert lo <= mean <= hi
    assert paired_speedup({0: 1.0}, {1: 1.0}) is None
    assert paired_speedup({0: 2.0}, {0: 1.0}) == (2.0, None)  # one pair: no interval
