"""What a shared directory does to a store: blocks re-dumped, roots lost or replaced, foreign
files (symlinks, FIFOs) at block names, a permissive umask. Real files, real store instances."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time

import numpy as np
import pytest

from _store_test_helpers import block_for, files_under, key_of, unreadable_block_as_nobody

BLOCK = 64 << 10


def test_redumping_stored_blocks_of_a_full_store_evicts_nothing(make_store):
    store = make_store(capacity_gb=4 * (BLOCK + 4096) / (1 << 30))  # room for exactly 4 blocks
    keys = [key_of(i) for i in range(4)]
    blocks = [block_for(k, BLOCK) for k in keys]
    assert all(store.wait(store.dump(keys, blocks, [1] * 4)))
    assert all(store.wait(store.dump(keys, blocks, [1] * 4)))  # again: all stored, nothing written
    stats = store.stats()
    assert stats.evictions == 0 and stats.dump_skipped == 4
    assert store.lookup(keys) == [True] * 4


def test_a_deleted_root_is_not_recreated_and_writes_fail_logged_once(make_store, tmp_path, caplog):
    store = make_store()
    key = key_of(1)
    assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [True]
    shutil.rmtree(tmp_path / "store")
    with caplog.at_level(logging.ERROR, logger="ucm.store.nfs_store"):
        for i in range(3):
            k = key_of(10 + i)
            assert store.wait(store.dump([k], [block_for(k, 1000)], [1])) == [False]
    assert not (tmp_path / "store").exists(), "the store must not re-create a lost root"
    assert caplog.text.count("is gone or was replaced") == 1
    assert store.stats().dump_errors == 3
    assert store.lookup([key]) == [False]  # a miss: the request is recomputed


def test_a_replaced_root_is_refused(make_store, tmp_path):
    store = make_store()
    root = tmp_path / "store"
    shutil.rmtree(root)
    os.makedirs(root)
    (root / ".ucm-store").write_text("someone else's store\n")  # same path and marker, another directory
    k = key_of(2)
    assert store.wait(store.dump([k], [block_for(k, 1000)], [1])) == [False]
    assert files_under(str(root), ".kvb") == []


def test_an_intact_root_is_checked_again_only_after_a_second_or_a_failed_write(make_store, monkeypatch):
    """Each check is a stat and a read (round trips on NFS): not one per step's dumps."""
    from ucm.store import nfs_store

    checks = []
    real = nfs_store.lost_root
    monkeypatch.setattr(nfs_store, "lost_root", lambda roots: checks.append(1) or real(roots))
    store = make_store()
    for i in range(3):
        k = key_of(20 + i)
        assert store.wait(store.dump([k], [block_for(k, 1000)], [1])) == [True]
    assert len(checks) == 1
    monkeypatch.setattr(nfs_store, "ROOT_CHECK_S", 0.0)
    k = key_of(30)
    assert store.wait(store.dump([k], [block_for(k, 1000)], [1])) == [True]
    assert len(checks) == 2


def test_a_symlink_at_a_block_name_is_never_followed(make_store, tmp_path):
    store = make_store()
    key = key_of(3)
    elsewhere = tmp_path / "elsewhere.kvb"
    elsewhere.write_bytes(b"not ours")
    path = store.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(elsewhere, path)
    dest = np.zeros(1000, np.uint8)
    assert store.wait(store.load([key], [dest])) == [False]  # refused, and removed as no block
    assert not os.path.lexists(path) and elsewhere.read_bytes() == b"not ours"
    assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [True]
    assert not os.path.islink(path) and store.wait(store.load([key], [dest])) == [True]


@pytest.mark.parametrize("level", [1, 2])
def test_a_symlinked_shard_directory_is_never_entered(make_store, tmp_path, level):
    """A shard directory replaced by a symlink would put blocks outside the store (never counted,
    never evicted): nothing is read, looked up or written through it."""
    store = make_store()
    key = key_of(6)
    path = store.block_path(key)
    shard = os.path.dirname(path) if level == 2 else os.path.dirname(os.path.dirname(path))
    outside = tmp_path / "outside"
    os.makedirs(shard, exist_ok=True)
    shutil.rmtree(shard)
    target = outside / os.path.relpath(shard, tmp_path / "store")
    os.makedirs(target, exist_ok=True)
    os.symlink(target, shard)
    # A block placed behind the symlink is not the store's.
    planted = target / os.path.relpath(path, shard)
    os.makedirs(planted.parent, exist_ok=True)
    other = make_store(storage_backends=str(tmp_path / "plain"))
    assert other.wait(other.dump([key], [block_for(key, 1000)], [1])) == [True]
    shutil.copy(other.block_path(key), planted)
    assert store.lookup([key]) == [False]
    assert store.wait(store.load([key], [np.zeros(1000, np.uint8)])) == [False]
    assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [False]
    assert files_under(str(outside), ".kvb") == [str(planted)]  # nothing written through the link
    assert store.stats().dump_errors == 1


def test_a_fifo_at_a_block_name_does_not_hang_loads(make_store):
    store = make_store(io_threads=1)
    stuck, ok_key = key_of(4), key_of(5)
    path = store.block_path(stuck)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    assert store.wait(store.dump([ok_key], [block_for(ok_key, 1000)], [1])) == [True]
    dests = [np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)]
    done = threading.Event()
    results = []

    def load():
        results.extend(store.wait(store.load([stuck, ok_key], dests)))
        done.set()

    threading.Thread(target=load, daemon=True).start()
    assert done.wait(10), "a FIFO at a block path blocked the IO thread"
    assert results == [False, True] and not os.path.lexists(path)


def test_files_and_directories_have_explicit_modes(make_store, tmp_path):
    old = os.umask(0)
    try:
        store = make_store(storage_backends=str(tmp_path / "umask0"))
        key = key_of(6)
        assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [True]
    finally:
        os.umask(old)
    path = store.block_path(key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "umask0").st_mode) == 0o755


@pytest.mark.parametrize("per_call", [False, True], ids=["load_timeout_s", "wait_timeout_s"])
def test_load_past_its_timeout_is_a_miss_and_the_store_goes_on(tmp_path, per_call):
    """One IO thread cannot verify 64 MiB in a millisecond: the load is abandoned as a miss (the
    engine recomputes), counted, and its buffers stay pinned until the IO returns. The deadline is
    the store's load_timeout_s, or the caller's own (the scheduler's small reads take a lookup's)."""
    from ucm.store import UcmNfsStore

    keys = [bytes([i]) * 16 for i in range(16)]
    blocks = [np.full(4 << 20, i, dtype=np.uint8) for i in range(16)]
    writer = UcmNfsStore({"storage_backends": str(tmp_path)})
    assert writer.wait(writer.dump(keys, blocks, [1] * 16)) == [True] * 16
    writer.close()
    store = UcmNfsStore({"storage_backends": str(tmp_path), "io_threads": 1,
                         "load_timeout_s": 600 if per_call else 0.001})
    dest = [np.zeros(4 << 20, dtype=np.uint8) for _ in keys]
    task = store.load(keys, dest)
    assert store.wait(task, 0.001 if per_call else None) == [False] * 16 and task.timed_out
    assert store.stats().load_timeouts == 16 and store.stats().load_errors == 16
    deadline = time.monotonic() + 30
    while store.abandoned("load") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.abandoned("load") == 0  # the IO returned: buffers released
    store.close()
    patient = UcmNfsStore({"storage_backends": str(tmp_path)})
    assert patient.wait(patient.load(keys, dest)) == [True] * 16  # nothing was lost or damaged
    assert all(int(d[0]) == i for i, d in enumerate(dest))
    patient.close()


def test_dump_past_its_timeout_is_not_waited_for_and_is_accounted_when_its_io_returns(tmp_path):
    """One IO thread cannot write 64 MiB in a millisecond: the caller stops waiting (a hung mount
    must not stall the worker), the blocks count as not stored, and when the IO returns the store
    accounts it: the blocks are there, whole, and the capacity reserved for them is settled."""
    from ucm.store import UcmNfsStore

    keys = [bytes([i]) * 16 for i in range(16)]
    blocks = [np.full(4 << 20, i, dtype=np.uint8) for i in range(16)]
    store = UcmNfsStore({"storage_backends": str(tmp_path), "io_threads": 1, "dump_timeout_s": 0.001,
                         "capacity_gb": 1, "down_backoff_s": 0})  # the accounting, not the breaker
    assert store.wait_open_scan(30)  # a scan that sees blocks as they are released counts them twice
    task = store.dump(keys, blocks, [1] * 16)
    del blocks  # the store pins the sources until the IO returns
    assert store.wait(task) == [False] * 16 and task.timed_out
    assert store.stats().dump_timeouts == 16 and store.stats().dump_blocks == 0
    deadline = time.monotonic() + 30
    while store.abandoned("dump") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.abandoned("dump") == 0
    stats = store.stats()
    assert stats.dump_blocks == 16 and stats.dump_errors == 0  # written after all, and counted so
    assert store.reserved_bytes == 0  # the reservation is settled
    assert store.used_bytes == sum(os.path.getsize(store.block_path(k)) for k in keys)
    dest = [np.zeros(4 << 20, dtype=np.uint8) for _ in keys]
    assert store.wait(store.load(keys, dest)) == [True] * 16
    assert all(int(d[0]) == i and int(d[-1]) == i for i, d in enumerate(dest))
    store.close()


def test_a_block_failing_with_an_io_error_is_quarantined():
    """A block that exists but cannot be read (here: no permission, EACCES) must not be looked up,
    failed and recomputed on every request: after one failed load it is a miss in that process."""
    import multiprocessing as mp

    from ucm.store import UcmNfsStore

    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="ucm-quarantine-"))  # reachable by the unprivileged child
    os.chmod(root, 0o777)
    store = UcmNfsStore({"storage_backends": str(root)})
    key = key_of(8)
    assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [True]
    store.close()
    os.chmod(store.block_path(key), 0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=unreadable_block_as_nobody, args=(str(root), key, out))
    p.start()
    before, loaded, after, quarantined = out.get(timeout=60)
    p.join(30)
    assert (before, loaded, after, quarantined) == ([True], [False], [False], 1)
    assert os.path.exists(store.block_path(key))  # not removed: other processes may read it
    shutil.rmtree(root)


def test_a_lookup_past_its_timeout_is_all_misses_and_so_is_every_lookup_until_it_returns(make_store):
    """The scheduler asks the store on every step: a lookup the file system does not answer in
    time (here: 100,000 stats cannot finish in 10 ms) is all misses, and lookups while it is still
    blocked are answered at once, as misses, instead of queueing behind it. (A 1 ms deadline also
    timed out single-key lookups after the release on a loaded host, doubling the back-off past the
    loop's 30 s.)"""
    key = key_of(1)
    writer = make_store()
    assert writer.wait(writer.dump([key], [block_for(key, 1000)], [1])) == [True]
    # A back-off long enough that it cannot end between the two lookups, even while the first one's
    # stat threads hold every core of a loaded machine.
    store = make_store(lookup_timeout_s=0.01, down_backoff_s=1.0)
    many = [key] + [key_of(1000 + i) for i in range(100_000)]
    assert store.lookup(many) == [False] * len(many)  # the stored block too: not answered in time
    t0 = time.monotonic()
    assert store.lookup([key]) == [False]  # the first lookup is still statting: a miss at once
    assert time.monotonic() - t0 < 0.1
    stats = store.stats()  # the store counts as down: the second lookup did not reach the mount
    assert stats.lookup_timeouts == len(many) and stats.down_refusals == 1 and stats.down_trips == 1
    deadline = time.monotonic() + 30
    while not store.lookup([key])[0]:  # answers again once the slow lookup has returned
        assert time.monotonic() < deadline, "lookups never answered again"
        time.sleep(0.01)


def test_a_dump_while_lookups_do_not_answer_is_refused_at_once(make_store):
    """A dump checks which blocks are stored with a lookup: while the file system does not answer
    one (here 100,000 stats), the dump is refused at once instead of blocking the worker in a
    hung mount; it writes nothing, and the block can be stored later."""
    store = make_store(lookup_timeout_s=0.001)
    key = key_of(7)
    assert store.lookup([key_of(1000 + i) for i in range(100_000)]) == [False] * 100_000
    t0 = time.monotonic()
    task = store.dump([key], [block_for(key, 1000)], [1])
    assert store.wait(task) == [False]
    assert task.refused  # answered without IO; the time is a loose backstop (CI shares its 2 cores)
    assert time.monotonic() - t0 < 0.5
    assert not os.path.exists(store.block_path(key))
    assert store.stats().dump_errors == 1 and store.stats().down_refusals == 1
    patient = make_store()  # the same directory, default lookup timeout
    assert patient.wait(patient.dump([key], [block_for(key, 1000)], [1])) == [True]


def test_lookups_without_a_timeout_run_in_the_calling_thread(make_store):
    store = make_store(lookup_timeout_s=0)
    key = key_of(2)
    assert store.wait(store.dump([key], [block_for(key, 1000)], [1])) == [True]
    before = {t.name for t in threading.enumerate()}
    assert store.lookup([key, key_of(3)]) == [True, False]
    assert "ucm-store-lookup" not in {t.name for t in threading.enumerate()} - before
    assert store.stats().lookup_timeouts == 0


def _hold_ledger_lock(directory):
    """Another process holding the usage ledger's lock and never letting go: what a writer stuck
    in a hung mount (or the hung mount itself) looks like to the store."""
    import subprocess
    import sys

    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.join(str(directory), ".ucm-usage")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _ledger(directory):
    from ucm.store.usage_ledger import UsageLedger

    return UsageLedger(str(directory)).update(lambda u: None)


def test_a_hung_usage_ledger_refuses_dumps_within_the_lookup_timeout_and_nothing_leaks(tmp_path):
    """With capacity_gb every dump first reserves its bytes under the ledger's fcntl lock. While
    that lock does not come (a hung mount), a dump is refused after lookup_timeout_s, the next
    ones at once, and nothing is written; once it answers, dumps work again and the refused
    dumps left no reservation in the ledger."""
    from ucm.store import UcmNfsStore

    store = UcmNfsStore({"storage_backends": str(tmp_path), "capacity_gb": 1, "lookup_timeout_s": 0.2,
                         "down_backoff_s": 0.2})
    assert store.wait_open_scan(30)
    keys = [key_of(i) for i in range(4)]
    blocks = [block_for(k, BLOCK) for k in keys]
    holder = _hold_ledger_lock(tmp_path)
    try:
        t0 = time.monotonic()
        task = store.dump(keys, blocks, [1] * 4)
        first_s = time.monotonic() - t0
        assert store.wait(task) == [False] * 4 and task.timed_out
        t0 = time.monotonic()
        again = store.dump(keys, blocks, [1] * 4)
        again_s = time.monotonic() - t0
        assert store.wait(again) == [False] * 4
    finally:
        holder.kill()
        holder.wait()
    assert 0.15 < first_s < 2.0, first_s  # waited for the lock about lookup_timeout_s, not for ever
    assert again_s < 0.1, again_s  # the store counts as down: not waited for again
    stats = store.stats()
    assert stats.ledger_timeouts == 4 and stats.down_refusals == 4 and stats.dump_errors == 8
    assert stats.dump_blocks == 0
    assert files_under(str(tmp_path)) == []  # nothing written, not even a temp file
    deadline = time.monotonic() + 10
    while not all(store.wait(store.dump(keys, blocks, [1] * 4))) and time.monotonic() < deadline:
        time.sleep(0.05)  # the blocked ledger call returns once the lock is free
    assert store.lookup(keys) == [True] * 4
    usage = _ledger(tmp_path)
    assert usage.reserved == {} and store.reserved_bytes == 0  # the refused dumps reserved nothing
    assert usage.committed == sum(os.path.getsize(store.block_path(k)) for k in keys)
    store.close()


def test_a_dump_finishing_while_the_ledger_hangs_is_not_held_up_and_is_accounted_later(tmp_path):
    """The ledger learns what a dump kept when its IO is waited for; a hung ledger must not hold
    that wait up. The update is queued and applied when the ledger answers."""
    from ucm.store import UcmNfsStore

    store = UcmNfsStore({"storage_backends": str(tmp_path), "capacity_gb": 1, "lookup_timeout_s": 0.2})
    assert store.wait_open_scan(30)
    keys = [key_of(i) for i in range(4)]
    task = store.dump(keys, [block_for(k, BLOCK) for k in keys], [1] * 4)
    while not store.check(task):
        time.sleep(0.01)
    holder = _hold_ledger_lock(tmp_path)
    try:
        t0 = time.monotonic()
        assert store.wait(task) == [True] * 4
        assert time.monotonic() - t0 < 2.0
        assert store.reserved_bytes == 0  # this process's view is settled at once
    finally:
        holder.kill()
        holder.wait()
    size = sum(os.path.getsize(store.block_path(k)) for k in keys)
    deadline = time.monotonic() + 10
    while (usage := _ledger(tmp_path)).reserved and time.monotonic() < deadline:
        time.sleep(0.05)
    assert usage.reserved == {} and usage.committed == size
    store.close()
