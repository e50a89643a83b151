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


def test_lookup_threads_follow_the_cost_of_a_stat():
    """A lookup's stat threads are sized by what a stat cost in the last lookup: one path per
    thread where each is a server's round trip, none beside the caller's for a local directory's
    few dozen, and the old four per thread before anything was measured."""
    from ucm.store._native import IoEngine

    assert IoEngine.stats_per_thread(0) == 4
    assert IoEngine.stats_per_thread(15_000_000) == 1  # a few round trips of 5 ms
    assert IoEngine.stats_per_thread(5_000) == 40  # a warm local stat


def test_lookups_of_many_keys_answer_each_as_stored_however_they_are_split(make_store):
    """Local stats are cheap: a few threads at most, and after a lookup of few paths the next one
    of many is split differently; every answer stays the file's own."""
    from _store_test_helpers import block_for, key_of

    store = make_store()
    keys = [key_of(i) for i in range(600)]
    stored = keys[::7]
    stored_set = set(stored)
    assert store.wait(store.dump(stored, [block_for(k, 512) for k in stored], [1] * len(stored))) == \
        [True] * len(stored)
    expected = [k in stored_set for k in keys]
    for n in (1, 600, 3, 600, 50, 600):
        assert store.lookup(keys[:n]) == expected[:n]
