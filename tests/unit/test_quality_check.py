"""benchmarks/quality_check.py's verdict: when the default rule's KL counts as a regression."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_check.py"
spec = importlib.util.spec_from_file_location("quality_check", SCRIPT)
quality_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality_check)


def _run(query_kl, hkvd_kl, model="/cache/SmolLM2-135M-Instruct", commit="abc"):
    return {"config": {"model": model, "commit": commit},
            "summary": [{"mode": "full prefill", "kl_vs_full": None}, {"mode": "blend 0.15", "kl_vs_full": query_kl},
                        {"mode": "hkvd 0.15", "kl_vs_full": hkvd_kl}]}


def test_within_tolerance_of_the_accepted_run_and_below_hkvd_passes():
    assert quality_check.verdict(_run(0.11, 0.5), _run(0.10, 0.5, model="/other/home/SmolLM2-135M-Instruct"),
                                 tolerance=0.25) == []
    assert quality_check.verdict(_run(0.11, 0.5), None, tolerance=0.25) == []


def test_a_tripled_kl_is_a_regression_naming_the_accepted_commit():
    problems = quality_check.verdict(_run(0.30, 0.5), _run(0.10, 0.5, commit="2529932"), tolerance=0.25)
    assert len(problems) == 1 and "above the accepted 0.1000 (commit 2529932)" in problems[0]


def test_losing_to_hkvd_is_a_regression_and_other_models_are_not_compared():
    problems = quality_check.verdict(_run(0.6, 0.5, model="/c/Qwen2.5-Coder-0.5B-Instruct"), _run(0.1, 0.5),
                                     tolerance=0.25)
    assert problems == ["the default rule's KL 0.6000 is above HKVD's 0.5000"]
