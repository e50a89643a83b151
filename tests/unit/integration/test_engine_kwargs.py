"""The engine settings make_llm adds: on CPU, vLLM's own compilation is left on (a Blend server
computes what it cannot blend as fast as plain vLLM); elsewhere eager mode."""

import pytest

pytest.importorskip("vllm")

from ucm.integration.vllm.llm import engine_kwargs, is_cpu_platform, ucm_transfer_config  # noqa: E402


def test_cpu_engines_keep_vllms_compilation(tmp_path):
    if not is_cpu_platform():
        pytest.skip("vLLM does not run on CPU here")
    blend = engine_kwargs("model", kv_transfer_config=ucm_transfer_config(tmp_path, blend_ratio=0.3))
    assert "enforce_eager" not in blend and "enforce_eager" not in engine_kwargs("model")
    assert engine_kwargs("model", enforce_eager=True)["enforce_eager"] is True  # a caller may still ask


def test_other_platforms_run_eager(monkeypatch):
    monkeypatch.setattr("ucm.integration.vllm.llm.is_cpu_platform", lambda: False)
    assert engine_kwargs("model")["enforce_eager"] is True
