"""The fault-injection benchmark at CI scale (benchmarks/store_faults.py --quick): real files and
real processes; its figures are printed and checked against the store's targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_store_faults_quick(tmp_path):
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "store_faults.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["concurrency"]["verified_loads"] > 0 and r["concurrency"]["wrong_reads"] == 0
    assert r["sigkill"]["visible_blocks"] > 0 and r["sigkill"]["torn_blocks"] == 0
    c = r["corruption"]
    assert c["detected"] == c["corrupted"] and c["served_wrong"] == 0 and c["wrong_token_counts_reported"] == 0
    cap = r["capacity"]
    assert cap["peak_over_blocks"] <= 2 * cap["writers"] and cap["final_over_blocks"] == 0
    assert r["hot_blocks"]["survived"] == r["hot_blocks"]["hot"]
    assert r["lost_root"]["dump_refused"] and not r["lost_root"]["tree_recreated"]
    f = r["fifo_timeout"]
    assert f["fifo_results"] == [False, True] and f["fifo_loads_returned_s"] < 10
    assert f["timed_out_blocks"] == 16 and f["timed_out_served"] == 0 and f["timeout_load_returned_s"] < 5
    g = r["ledger_lock"]
    assert g["written_while_held"] == 0 and g["refused_blocks"] == 8
    # the first dump waits for the lock; the store then counts as down and refuses the rest at once
    assert g["ledger_timeouts"] == 2 and g["down_refusals"] == 6
    assert max(g["dump_returned_s"]) < 10 * g["lookup_timeout_s"] and g["dump_returned_s"][-1] < 0.1
    assert g["stored_after"] == 8 and g["reservations_left"] == 0
