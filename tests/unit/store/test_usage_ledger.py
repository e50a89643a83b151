"""The shared usage ledger: reservations per writer survive other processes' rescans; those of
dead writers do not. Real files; the other writers are real (dead or live) processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from ucm.store.usage_ledger import STALE_S, Usage, UsageLedger


def _reserve_and_die(directory: str) -> None:
    UsageLedger(directory).reserve(lambda total: (0, 500))


def test_a_rescan_keeps_other_writers_reservations(tmp_path):
    """Writer A reserves; B rescans the disk (A's block not there yet); A's bytes still count."""
    a, b = UsageLedger(str(tmp_path)), UsageLedger(str(tmp_path))
    b.host = "other-host"  # another machine on the same directory
    a.reserve(lambda total: (0, 100))
    b.reconcile(on_disk=1000, added_before_scan=0)
    assert a.total() == 1100
    a.release(100, kept=100)
    assert a.total() == 1100 and not Usage.parse(open(a.path, "rb").read()).reserved


def test_blocks_committed_during_a_scan_are_not_lost(tmp_path):
    """A block released after the scan passed its directory is not in the scan's count."""
    a, b = UsageLedger(str(tmp_path)), UsageLedger(str(tmp_path))
    b.host = "other-host"
    mark = b.added()  # b starts scanning
    a.reserve(lambda total: (0, 100))
    a.release(100, kept=100)  # written where b's scan had already looked
    b.reconcile(on_disk=1000, added_before_scan=mark)
    assert b.total() == 1100


def test_reservations_of_dead_writers_are_dropped_by_rescans(tmp_path):
    ledger = UsageLedger(str(tmp_path))
    p = mp.get_context("spawn").Process(target=_reserve_and_die, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert ledger.total() == 500  # the dead writer's reservation until a rescan
    ledger.reconcile(on_disk=0, added_before_scan=0)
    assert ledger.total() == 0


def test_stale_reservations_of_other_hosts_are_dropped(tmp_path):
    ledger = UsageLedger(str(tmp_path))
    fresh, stale = time.time(), time.time() - STALE_S - 1
    with open(ledger.path, "wb") as f:
        f.write(Usage(10, {"far:1": [7, fresh], "far:2": [9, stale]}).dump())
    ledger.reconcile(on_disk=10, added_before_scan=0)
    assert ledger.total() == 17


def test_make_room_sees_every_reservation(tmp_path):
    ledger = UsageLedger(str(tmp_path))
    ledger.reconcile(on_disk=50, added_before_scan=0)
    ledger.reserve(lambda total: (0, 20))
    seen = []
    ledger.reserve(lambda total: (seen.append(total), (40, 30))[1])  # evicts 40 bytes, reserves 30
    assert seen == [70] and ledger.total() == 60


def test_legacy_and_damaged_ledgers_parse(tmp_path):
    assert Usage.parse(b"12345").total == 12345
    assert Usage.parse(b"{not json").total == 0
    ledger = UsageLedger(str(tmp_path))
    with open(ledger.path, "wb") as f:
        f.write(b"4096      ")
    assert ledger.total() == 4096
    assert os.path.getsize(ledger.path) == len(Usage(4096).dump())
