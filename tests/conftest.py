import sys
from pathlib import Path

import pytest

# Helpers beside the tests (cpu_probes.py); importlib import mode does not put this folder on sys.path.
sys.path.insert(0, str(Path(__file__).parent))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded model, converted once per machine (see `python -m ucm.models prepare`)."""
    from ucm.models import prepare

    return prepare()


@pytest.fixture(scope="session")
def musique_path() -> Path:
    path = SHARED_DATA / "musique_dev.json"
    if not path.is_file():
        pytest.skip(f"evaluation data not present at {path}")
    return path


@pytest.fixture
def cache_write(monkeypatch):
    """vLLM's CPU cache-write op, as the layout code will call it in this test. Where this CPU's
    build cannot pack AMX pages, ISA "amx" is written by the reference tiling instead
    (cpu_probes.py), so the AMX page-map code is still tested there."""
    pytest.importorskip("vllm")
    import ucm.integration.vllm.kv_layout.cpu as kv_layout
    from cpu_probes import cache_write_op

    op = cache_write_op(kv_layout._vllm_cpu_reshape_and_cache())
    if op is None:
        pytest.skip("this vLLM build has no cpu_attn_reshape_and_cache")
    monkeypatch.setattr(kv_layout, "_vllm_cpu_reshape_and_cache", lambda: op)
    return op
