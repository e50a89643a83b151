"""The store on a mount that misbehaves for real: a FUSE passthrough (tests/fault_mount.py) over
a directory, hanging, slowing or failing calls as an NFS server does. Skipped where FUSE cannot
mount (no /dev/fuse, no libfuse, not root)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from _store_test_helpers import block_for, key_of
from fault_mount import FaultMount, mounted_or_skip

pytestmark = pytest.mark.skipif(FaultMount.available() is not None, reason=f"FUSE: {FaultMount.available()}")


@pytest.fixture
def mount(tmp_path):
    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as m:
        yield m


@pytest.fixture
def stored(mount, make_store):
    """A store on the mount with 4 blocks in it; short deadlines."""
    store = make_store(storage_backends=str(mount.mountpoint), load_timeout_s=1, lookup_timeout_s=1,
                       dump_timeout_s=1, down_backoff_s=0.5, down_backoff_max_s=2)
    keys = [key_of(i) for i in range(4)]
    assert store.wait(store.dump(keys, [block_for(k, 4096) for k in keys], [1] * 4)) == [True] * 4
    return store, keys


def _load(store, keys):
    dest = [np.zeros_like(block_for(k, 4096)) for k in keys]
    t0 = time.monotonic()
    ok = store.wait(store.load(keys, dest))
    return ok, time.monotonic() - t0, dest


def _until(predicate, seconds=15.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_reads_that_hang_cost_one_timeout_then_the_store_is_down_until_they_return(mount, stored):
    """What an NFS client with cached attributes shows: stats answer, opens and reads hang. One
    load pays its deadline; lookups, loads and dumps after it are answered at once, without IO,
    while the reads stay hung (however many back-offs pass); after release the store serves again."""
    store, keys = stored
    mount.set(hang=["open", "read"])
    ok, seconds, _ = _load(store, keys)
    assert ok == [False] * 4 and 0.9 < seconds < 3
    assert store.stats().down_trips == 1 and store.down_for_s() > 0
    for _ in range(3):  # lookups, loads and dumps: at once, misses
        t0 = time.monotonic()
        assert store.lookup(keys) == [False] * 4
        assert _load(store, keys)[0] == [False] * 4
        assert store.load(keys, [np.zeros(4096, np.uint8) for _ in keys]).refused  # said so, for the counters
        new = key_of(99)
        assert store.wait(store.dump([new], [block_for(new, 4096)], [1])) == [False]
        assert time.monotonic() - t0 < 0.2
        time.sleep(0.6)  # past a back-off: the timed-out reads are still hung, so still down
    assert store.abandoned("load") == 1  # nothing more was sent into the hung mount
    stats = store.stats()
    assert stats.load_timeouts == 4 and stats.down_refusals == 3 * (4 + 4 + 4 + 1) and stats.down_trips > 1
    mount.set()
    _until(lambda: store.down_for_s() == 0)
    ok, _, dest = _load(store, keys)
    assert ok == [True] * 4
    assert all(np.array_equal(d, block_for(k, 4096)) for d, k in zip(dest, keys))
    assert store.lookup(keys) == [True] * 4


def test_a_dump_on_a_mount_whose_opens_hang_does_not_block_its_caller(mount, stored):
    """A dump reads the root's marker (an open) before writing: on a mount whose opens hang it is
    refused within the lookups' deadline instead of blocking the worker, and nothing is written."""
    store, _ = stored
    mount.set(hang=["open"])
    new = key_of(50)
    t0 = time.monotonic()
    assert store.wait(store.dump([new], [block_for(new, 4096)], [1])) == [False]
    assert time.monotonic() - t0 < 2.5
    assert store.down_for_s() > 0
    mount.set()
    _until(lambda: store.down_for_s() == 0)
    assert store.wait(store.dump([new], [block_for(new, 4096)], [1])) == [True]
    assert _load(store, [new])[0] == [True]


def test_reads_failing_with_eio_are_misses_and_do_not_count_the_store_as_down(mount, stored):
    store, keys = stored
    mount.set(eio=["read"])
    assert _load(store, keys)[0] == [False] * 4
    stats = store.stats()
    assert stats.quarantined == 4 and stats.down_trips == 0 and stats.load_timeouts == 0
    mount.set()
    assert store.lookup(keys) == [False] * 4  # quarantined in this process: not read again for a while


def test_a_slow_mount_is_slow_not_down(mount, stored):
    """5 ms on every call (a loaded NFS server) and reads capped at 50 MB/s: every block still
    comes back whole and nothing times out."""
    store, keys = stored
    mount.set(latency_ms=5, bandwidth_mb_s=50)
    ok, seconds, dest = _load(store, keys)
    assert ok == [True] * 4 and seconds < 1
    assert all(np.array_equal(d, block_for(k, 4096)) for d, k in zip(dest, keys))
    assert store.stats().down_trips == 0


def test_lookups_on_a_slow_mount_answer_every_key_as_stored(mount, make_store):
    """With 5 ms on every call the lookup stats one path per thread (sized by the last lookup's
    cost per stat): every key of a large lookup, stored or not, answered as it is, call after call."""
    store = make_store(storage_backends=str(mount.mountpoint))
    keys = [key_of(i) for i in range(120)]
    stored = keys[::3]
    stored_set = set(stored)
    assert store.wait(store.dump(stored, [block_for(k, 1024) for k in stored], [1] * len(stored))) == \
        [True] * len(stored)
    mount.set(latency_ms=5)
    expected = [k in stored_set for k in keys]
    for _ in range(3):
        assert store.lookup(keys) == expected
    assert store.lookup(keys[:1]) == [True] and store.lookup([]) == []
    assert store.stats().down_trips == 0


def test_a_hung_load_pays_what_its_bytes_would_take_on_a_slow_link_not_load_timeout_s(mount, make_store):
    """A step waits for its loads: a small load on a mount whose reads hang is given up after
    LOAD_GRACE_S plus its bytes at load_min_mb_s, well before load_timeout_s; a larger one gets
    longer, in proportion."""
    from ucm.store.config import LOAD_GRACE_S

    store = make_store(storage_backends=str(mount.mountpoint), load_timeout_s=30, load_min_mb_s=1,
                       lookup_timeout_s=1, down_backoff_s=0)
    small, large = [key_of(i) for i in range(2)], [key_of(i) for i in range(2, 4)]
    assert store.wait(store.dump(small, [block_for(k, 4096) for k in small], [1] * 2)) == [True] * 2
    assert store.wait(store.dump(large, [block_for(k, 1_000_000) for k in large], [1] * 2)) == [True] * 2
    mount.set(hang=["open", "read"])
    task = store.load(small, [np.zeros_like(block_for(k, 4096)) for k in small])
    deadline = store.load_deadline_s(task)
    assert LOAD_GRACE_S < deadline < LOAD_GRACE_S + 0.1
    t0 = time.monotonic()
    assert store.wait(task) == [False] * 2
    assert deadline - 0.1 < time.monotonic() - t0 < deadline + 1
    task = store.load(large, [np.zeros_like(block_for(k, 1_000_000)) for k in large])
    assert store.load_deadline_s(task) == pytest.approx(LOAD_GRACE_S + 2 * block_for(large[0], 1_000_000).nbytes / 1e6)
    mount.set()
    assert store.wait(task) == [True] * 2


def test_load_min_mb_s_zero_leaves_load_timeout_s_alone(make_store):
    store = make_store(load_timeout_s=7, load_min_mb_s=0)
    key = key_of(0)
    assert store.wait(store.dump([key], [block_for(key, 4096)], [1])) == [True]
    task = store.load([key], [np.zeros_like(block_for(key, 4096))])
    assert store.load_deadline_s(task) == 7 and store.wait(task) == [True]
    assert make_store(load_timeout_s=0).load_deadline_s(task) is None


def test_the_bandwidth_cap_is_one_link_for_all_readers(mount):
    """Four threads reading 1 MB each at once through a 20 MB/s cap take the link's 0.2 s, not a
    quarter of it: the cap is what a client behind one loaded NFS link sees."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"f{i}" for i in range(4)]
    for name in names:
        (mount.source / name).write_bytes(b"x" * 1_000_000)
    mount.set(bandwidth_mb_s=20)

    def read(name):
        return len((mount.mountpoint / name).read_bytes())

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(read, names)) == [1_000_000] * 4
    assert time.monotonic() - t0 > 0.19


def test_after_a_long_hang_the_store_is_up_as_soon_as_the_mount_answers(mount, make_store):
    """Reads hang for several back-offs (the back-off grows towards its maximum, 30 s here): when
    the mount is released, the timed-out reads return and a probe of the mount answers, so the
    store is up again within a second or so, not at the end of the back-off it was in."""
    store = make_store(storage_backends=str(mount.mountpoint), load_timeout_s=0.5, lookup_timeout_s=1,
                       down_backoff_s=0.2, down_backoff_max_s=30)
    keys = [key_of(i) for i in range(2)]
    assert store.wait(store.dump(keys, [block_for(k, 4096) for k in keys], [1] * 2)) == [True] * 2
    mount.set(hang=["open", "read"])
    assert _load(store, keys)[0] == [False] * 2
    _until(lambda: store.down_for_s() > 2.5, seconds=10)  # back-offs end and start again, doubling
    assert store.stats().down_trips > 2
    mount.set()
    t0 = time.monotonic()
    _until(lambda: store.down_for_s() == 0, seconds=5)
    assert time.monotonic() - t0 < 1.5  # the back-off it was in had over 2.5 s left
    assert _load(store, keys)[0] == [True] * 2


def test_the_mount_reports_the_cpu_its_server_used(tmp_path):
    """Benchmarks set the test mount's own CPU beside a stream's time (an NFS server's would not
    be on these cores): it grows with the calls served and is None once the server is gone."""
    with mounted_or_skip(tmp_path / "server", tmp_path / "mnt") as m:
        before = m.cpu_seconds()
        assert before is not None and before >= 0
        payload = b"x" * (1 << 20)
        for i in range(64):
            (m.mountpoint / f"f{i}").write_bytes(payload)
            assert (m.mountpoint / f"f{i}").read_bytes() == payload
        assert m.cpu_seconds() > before
    assert m.cpu_seconds() is None


def test_layer_groups_read_over_the_link_no_more_than_their_bytes(mount, make_store):
    """A run of segments that stops short of the block's end (a layer group) is not read ahead:
    the kernel would fetch the next groups' bytes over the link, and a mount that drops a file's
    cached pages when it is opened again (FUSE by default) would fetch them again for them."""
    store = make_store(storage_backends=str(mount.mountpoint), io_threads=2)
    segments, seg = 30, 96 << 10
    keys = [key_of(i) for i in range(4)]
    assert store.wait(store.dump(keys, [block_for(k, segments * seg) for k in keys], [1] * 4,
                                 segments=segments)) == [True] * 4
    groups = [(0, 2)] + [(a, min(4, segments - a)) for a in range(2, segments, 4)]
    before = mount.read_bytes()
    for first, count in groups:
        dests = [[np.zeros(seg, dtype=np.uint8) for _ in range(count)] for _ in keys]
        assert store.wait(store.load_segments(keys, dests, first, segments)) == [True] * 4
    served, wanted = mount.read_bytes() - before, len(keys) * segments * seg
    # Each group also reads the block's 4 KiB header; requests from the kernel add a little.
    assert wanted <= served < 1.1 * wanted, (served, wanted)
