"""DeadlineThread: calls that may block, waited for at most a deadline (store/deadline.py)."""

from __future__ import annotations

import threading
import time

import pytest

from ucm.store.deadline import DeadlineThread


def test_calls_return_their_value_or_raise_in_the_caller():
    calls = DeadlineThread("test")
    assert calls.run(lambda: 42, 5).result() == 42
    call = calls.run(lambda: open("/nonexistent/ucm-deadline-test"), 5)
    with pytest.raises(FileNotFoundError):
        call.result()
    calls.close()


def test_a_call_past_its_deadline_makes_later_ones_answer_at_once_until_it_returns():
    calls = DeadlineThread("test")
    gate, order = threading.Event(), []
    t0 = time.monotonic()
    assert calls.run(lambda: (gate.wait(30), order.append("blocked")), 0.1) is None
    assert 0.09 < time.monotonic() - t0 < 5
    assert calls.hung
    t0 = time.monotonic()
    assert calls.run(lambda: order.append("dropped"), 5) is None  # not waited for, not run
    assert calls.run(lambda: order.append("queued"), 5, queue_when_hung=True) is None
    assert time.monotonic() - t0 < 0.05
    gate.set()
    deadline = time.monotonic() + 10
    while calls.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.run(lambda: order.append("after"), 5) is not None
    assert order == ["blocked", "queued", "after"]  # in order, the dropped one never ran
    calls.close()


def test_after_close_calls_run_in_the_caller():
    calls = DeadlineThread("test")
    assert calls.run(lambda: 1, 5).result() == 1
    calls.close()
    assert calls.run(threading.get_ident, 5).result() == threading.get_ident()
