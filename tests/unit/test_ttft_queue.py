"""benchmarks/ttft_queue.py: what each request found in flight when it arrived."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
spec = importlib.util.spec_from_file_location("ttft_queue", BENCHMARKS / "ttft_queue.py")
tq = importlib.util.module_from_spec(spec)
sys.modules["ttft_queue"] = tq  # dataclasses look their module up there
spec.loader.exec_module(tq)


def record(start, ttft, blended):
    return {"start_s": start, "ttft_s": ttft, "blended": blended}


def test_prefills_in_flight_and_blends_that_overtook():
    records = [record(0.0, 10.0, False),  # a full prefill, first token at 10
               record(1.0, 15.0, False),  # arrives behind it
               record(2.0, 3.0, True),  # a blend request: arrives behind both, done at 5, before both
               record(12.0, 1.0, False)]  # arrives when the first is done, the second still running
    a = tq.arrivals(records, skip=0)
    assert [(x.prefills_ahead, x.blends_ahead, x.overtaken_by) for x in a] == [(0, 0, 1), (1, 0, 1), (2, 0, 0),
                                                                              (1, 0, 0)]
    assert [x.blended for x in a] == [False, False, True, False]
    assert len(tq.arrivals(records, skip=2)) == 2
