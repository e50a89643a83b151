"""End-to-end tests start real vLLM engines (about 40 s each on 2 cores): all marked slow."""

import gc

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def engine_factory():
    """Builds LLMs with the project's defaults and stops their processes after the test."""
    from ucm.integration.vllm.llm import make_llm

    engines = []

    def make(model, **overrides):
        llm = make_llm(str(model), **overrides)
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    engines.clear()
    gc.collect()
