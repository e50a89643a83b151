"""docs/results.md and README.md's headline table are printed from benchmarks/results/*.json:
they must say what the JSON says (regenerate with `python benchmarks/make_results.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_results():
    spec = importlib.util.spec_from_file_location("make_results", REPO / "benchmarks" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_the_json_printed():
    mr = make_results()
    assert (REPO / "docs" / "results.md").read_text() == mr.results_page()


def test_readme_headline_is_the_json_printed():
    mr = make_results()
    readme = (REPO / "README.md").read_text()
    block = readme.split(mr.HEADLINE_BEGIN, 1)[1].split(mr.HEADLINE_END, 1)[0]
    assert block.strip() == mr.headline().strip()
    assert "| `vllm serve`" in block  # the serving row exists: serve_bench.json is in the repository


def test_relative_links_and_named_result_files_exist():
    """Every relative link of README.md and docs/*.md resolves, and every results JSON the prose
    names (`something.json`) is in benchmarks/results/."""
    import re

    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not link.startswith(("http://", "https://")):
                assert (page.parent / link).exists(), f"{page.name}: broken link {link}"
        for name in set(re.findall(r"`([a-z0-9_]+\.json)`", text)):
            assert (REPO / "benchmarks" / "results" / name).exists() or name in ("config.json",), \
                f"{page.name} names {name}, which is not in benchmarks/results/"


def test_every_results_section_has_its_json():
    """A section of docs/results.md whose JSON is not in the repository would print "(not run)"."""
    assert "(not run)" not in make_results().results_page()


def test_alone_lines_give_both_variants_when_the_run_has_them():
    mr = make_results()
    summary = {"alone_requests": 2, "alone_ttft_p50_s": 8.0, "alone_stream_ttft_p50_s": 20.0, "high_hit_vs_alone": 2.5,
               "alone_chunk_hit_rate": 1.0, "alone_stream_chunk_hit_rate": 0.9}
    run = {"server": "blend", "load": "c=2", "summary": summary}
    assert len(mr.alone_lines(run)) == 1 and "2.50x" in mr.alone_lines(run)[0]
    summary.update({"alone_same_misses_requests": 2, "alone_same_misses_ttft_p50_s": 11.0,
                    "high_hit_vs_alone_same_misses": 1.8, "alone_same_misses_chunk_hit_rate": 0.9,
                    "alone_same_misses_stream_chunk_hit_rate": 0.9})
    first, second = mr.alone_lines(run)
    assert "2.50x" in first and "**1.80x**" in second and "11.00 s" in second
    assert mr.alone_lines({**run, "summary": {}}) == []


def test_kl_lines_compare_blend_with_a_plain_run_of_any_load_that_recorded_logprobs():
    import math
    mr = make_results()
    p, q = [[1, math.log(0.5)], [2, math.log(0.4)]], [[1, math.log(0.4)], [2, math.log(0.5)]]
    plain = {"server": "plain", "load": "c=2", "records": [{"i": 0, "first_logprobs": p}, {"i": 1, "first_logprobs": p}]}
    blend = {"server": "blend", "load": "c=4", "records": [{"i": 0, "blended": True, "first_logprobs": q},
                                                          {"i": 1, "blended": False, "first_logprobs": p}]}
    (line,) = mr.kl_lines({"runs": [blend, plain]})
    kl = 0.5 * math.log(0.5 / 0.4) + 0.4 * math.log(0.4 / 0.5)
    assert "Blend at c=4 against plain at c=2" in line and f"mean {kl / 2:.4f} over 2 requests" in line
    assert f"blended requests' mean {kl:.4f} (1)" in line
    assert mr.kl_lines({"runs": [blend, {**plain, "records": [{"i": 0}]}]}) == []


def _run(skip: int, answers: list[tuple[float, float, bool]]) -> dict:
    """A blend_bench JSON of questions skip.. with (full prefill's gold F1, blend's, the same answer)."""
    return {"config": {"skip_questions": skip}, "questions": [
        {"question": i, "measurements": [{"mode": "full prefill", "f1_gold": full},
                                         {"mode": "blend 0.15", "f1_gold": blend, "agrees_with_full": same,
                                          "kl_vs_full": 0.1}]}
        for i, (full, blend, same) in enumerate(answers)]}


def test_pooled_runs_count_each_question_of_the_set_once():
    mr = make_results()
    first = _run(0, [(1.0, 1.0, True), (1.0, 0.0, False)])
    later = _run(2, [(0.5, 0.5, True), (0.5, 0.5, True)])
    again = _run(1, [(1.0, 1.0, True)])  # question 1 measured again: the first run's measurement counts
    row = mr.pooled_table([first, later, again], ["blend 0.15"]).splitlines()[-1].split(" | ")
    assert row[1:7] == ["4", "0.750", "0.500", "67%", "-0.250 (-0.750 .. +0.000)", "3 / 4"]
