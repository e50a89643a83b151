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
