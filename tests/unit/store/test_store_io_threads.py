"""The store's IO threads run on every core the process uses, even when created from a bound thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

IO_THREADS_SCRIPT = """
import os, sys, threading
from ucm.store import UcmNfsStore

def io_affinities():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            if open(f"/proc/self/task/{tid}/comm").read().strip() == "ucm-store-io":
                out.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:  # a thread that ended meanwhile (the closed store's housekeeper)
            pass
    return out

root = sys.argv[1]
store = UcmNfsStore({"storage_backends": root + "/a", "io_threads": 2})
print(io_affinities())
store.close()
ready, done = threading.Event(), threading.Event()
def bound_elsewhere():  # like vLLM's OpenMP thread bound to the second core
    os.sched_setaffinity(0, {1}); ready.set(); done.wait()
t = threading.Thread(target=bound_elsewhere); t.start(); ready.wait()
os.sched_setaffinity(0, {0})  # like vLLM's bound worker thread, which creates the store
store = UcmNfsStore({"storage_backends": root + "/b", "io_threads": 2})
print(io_affinities())
store.close()
done.set(); t.join()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs cores 0 and 1")
def test_io_threads_are_not_left_on_the_creating_threads_core(tmp_path):
    out = subprocess.run([sys.executable, "-c", IO_THREADS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    unbound, bound = out.stdout.split("\n")[:2]
    every = sorted(os.sched_getaffinity(0))
    assert unbound == str([every, every])  # inherited from an unbound creator: untouched
    assert bound == str([[0, 1], [0, 1]])  # not only core 0
