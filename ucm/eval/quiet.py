"""Readable output for the main job and the benchmarks: call before vLLM is imported.

vLLM logs at WARNING level and Python's deprecation and future warnings (torch's, vLLM's) are
hidden, unless `verbose` or the user's own VLLM_LOGGING_LEVEL / PYTHONWARNINGS say otherwise. Set
in the environment, so the engine processes vLLM spawns inherit it.
"""

from __future__ import annotations

import os
import warnings


def quiet_vllm(verbose: bool = False) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not verbose:
        os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
