"""End-to-end tests start real vLLM engines (about 40 s each on 2 cores): all marked slow.

Engines are session-scoped and shared: one plain engine (the reference: full prefill, vLLM's
own prefix cache), one engine with the UCM connector and Blend on a shared store directory, and,
for the store audits, a reference engine whose connector stores into a scratch directory.
"""

import sys
from pathlib import Path

import pytest

from ucm.integration.vllm.llm import shutdown, ucm_transfer_config

# blend_helpers.py sits next to the tests; importlib import mode does not put this folder on sys.path.
sys.path.insert(0, str(Path(__file__).parent))

# The tests' engines skip vLLM's compilation (about 40 s more per start on 2 cores); the README's
# server (test_serving.py) and the main job run compiled, as users' engines do.
EAGER = {"enforce_eager": True}


# Modules that start engines of their own beyond the session's shared ones (several each, or a
# tensor-parallel pair, or whole jobs in subprocesses): marked heavy, which `make test` leaves out to
# keep the default suite near 20 minutes on 2 cores (measured: 48 min with everything, 28 min
# without these modules, before the two tests below joined them); `make test-all` runs them.
HEAVY_MODULES = {
    "test_tensor_parallel": "three engines in subprocesses, one of them two TP workers",
    "test_architectures": "an engine per model architecture",
    "test_model_identity": "three engines on one store",
    "test_main_job": "the main job and the benchmark as subprocesses, several engines each",
    "test_shared_store": "two engines at once on one store",
    "test_blend_bfloat16": "a bfloat16 engine (about 3x slower where the CPU lacks native bfloat16)",
    "test_prefix_offload": "two engines one after the other",
    "test_larger_models": "a 0.5B model downloaded from PyPI, converted, loaded by transformers and by vLLM",
    "test_other_configs": "an engine with LMCache's chunk separator",
    "test_mount_faults": "an engine on a FUSE mount that hangs",
}
# Single tests with an engine of their own whose rules unit tests check on vLLM's real scheduler
# (tests/unit/integration): the e2e run adds the timing or the answers, at minutes each.
HEAVY_TESTS = {
    "test_a_blend_request_behind_a_running_prefill_and_a_waiting_one_goes_first": "three long prefills, timed",
    "test_preempted_blend_request_answers_as_unpreempted": "200-token answers in a 16-block KV cache",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
            if item.path.stem in HEAVY_MODULES or item.originalname in HEAVY_TESTS:
                item.add_marker(pytest.mark.heavy)


@pytest.fixture
def engine_factory():
    """Builds LLMs with the project's defaults, eager unless asked (`EAGER`), and stops their
    processes after the test."""
    from ucm.integration.vllm.llm import make_llm

    engines = []

    def make(model, **overrides):
        llm = make_llm(str(model), **{**EAGER, **overrides})
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        shutdown(llm)


@pytest.fixture(scope="session")
def plain_llm(model_dir):
    from ucm.integration.vllm.llm import make_llm

    llm = make_llm(str(model_dir), **EAGER)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ucm-store")


@pytest.fixture(scope="session")
def faults_file(tmp_path_factory):
    """The file the session's Blend engine reads its injected faults from (UCM_FAULTS): empty, no
    fault; test_blend_faults.py writes stage names into it for one request at a time."""
    path = tmp_path_factory.mktemp("faults") / "stages"
    path.write_text("")
    return path


@pytest.fixture(scope="session")
def blend_llm(model_dir, store_dir, faults_file):
    from blend_helpers import STORE_ALL

    from ucm.integration.vllm.faults import FAULTS_ENV
    from ucm.integration.vllm.llm import make_llm

    # Stats logging on: the connector's counters reach LLM.get_metrics() (test_statistics_counters...).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULTS_ENV, str(faults_file))
        llm = make_llm(str(model_dir), kv_transfer_config=ucm_transfer_config(store_dir, blend_ratio=0.15,
                                                                              blend_options=STORE_ALL),
                       disable_log_stats=False, **EAGER)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def audit_reference(model_dir, tmp_path_factory):
    """The store audit's reference engine (full prefill, prefix offload into a scratch directory):
    started once for every audit. Its users are the last modules (test_trust*.py), so it starts
    after the multi-engine tests; a small KV cache, beside the session's other engines."""
    from ucm.integration.vllm.llm import make_llm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = make_llm(str(model_dir), kv_transfer_config=ucm_transfer_config(tmp_path_factory.mktemp("audit-scratch")),
                       **EAGER)
    yield llm
    shutdown(llm)
