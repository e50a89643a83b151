"""Failing towards computing: faults in the cache path are caught, logged, counted, and the work
is left to vLLM's own computation. Also a fault-injection switch that tests use to prove it.

`UCM_FAULTS` names a file; each word in it (commas or white space between) names a stage whose
calls then raise `InjectedFault`, in every process, or with `@R` (`forward@1`) in the process of
rank R only (a fault on one tensor-parallel rank), or with `~P` (`load~0.1`) on a share P of its
calls, drawn at random (a storm of faults: benchmarks/fault_storm.py). A file rather than the
variable's value, so a test switches the faults of a running engine's processes on and off. Unset
(the default), `inject` costs one environment lookup.
"""

from __future__ import annotations

import logging
import os
import random

FAULTS_ENV = "UCM_FAULTS"
# lookup: the scheduler's plan of a request; load: reading and placing a step's KV; rotate: the
# RoPE shift of loaded chunk keys; select: the Blend forward's ranking; forward: the Blend
# forward after the check layer's selection (the cache partly written); attention: each layer's
# attention in the Blend forward's passes over a subset of rows; dump: storing a step's blocks.
STAGES = ("lookup", "load", "rotate", "select", "forward", "attention", "dump")


class InjectedFault(RuntimeError):
    """A fault raised on purpose by `inject` (tests)."""


def inject(stage: str) -> None:
    """Raises `InjectedFault` when the file named by UCM_FAULTS names `stage`."""
    path = os.environ.get(FAULTS_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            named = f.read().replace(",", " ").split()
    except OSError:
        return
    if stage in named or f"{stage}@{_rank()}" in named or _drawn(stage, named):
        raise InjectedFault(f"fault injected at stage {stage!r} ({FAULTS_ENV}={path})")


def _drawn(stage: str, named: list[str]) -> bool:
    """Whether a `stage~P` word names the stage and this call falls in its share P."""
    for word in named:
        name, sep, share = word.partition("~")
        if sep and name == stage:
            try:
                return random.random() < float(share)
            except ValueError:
                return False
    return False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ErrorLog:
    """Logs a stage's first error with its traceback and later ones in one line each, so a fault
    that repeats every step neither hides its cause nor floods the log."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._seen: set[str] = set()

    def error(self, stage: str, exc: BaseException, consequence: str) -> None:
        if stage in self._seen:
            self._logger.warning("UCM %s failed again (%s: %s); %s", stage, type(exc).__name__, exc, consequence)
            return
        self._seen.add(stage)
        self._logger.error("UCM %s failed; %s (later failures of this stage are logged in one line)", stage,
                           consequence, exc_info=exc)
