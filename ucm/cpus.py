"""Cores for threads we start ourselves.

vLLM's CPU worker binds each OpenMP thread to one core, its main thread included. A thread started
from that main thread (a kernel helper, a store IO thread) inherits its single core and competes
with it while the other cores idle. These helpers name the cores the process's threads use, so our
threads can be placed there instead.
"""

from __future__ import annotations

import os


def process_cpus() -> frozenset[int]:
    """Union of the cores the process's threads may run on (empty where the OS cannot tell)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    used: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return frozenset(os.sched_getaffinity(0))
    for tid in tids:
        try:
            used |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended
            pass
    return frozenset(used)


def other_cpus() -> frozenset[int]:
    """Cores the process's threads use that the calling thread may not (empty: the caller is not bound)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return process_cpus() - frozenset(os.sched_getaffinity(0))
