"""The circuit breaker's back-off on a clock the test moves."""

from __future__ import annotations

import pytest

from ucm.store.breaker import Breaker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_trip_opens_for_the_back_off_then_lets_calls_through_to_try():
    clock = Clock()
    b = Breaker(5, 60, clock)
    assert not b.is_open() and not b.is_trial() and b.remaining_s() == 0
    assert b.trip() == 5
    assert b.is_open() and b.remaining_s() == 5
    clock.now += 5
    assert not b.is_open() and b.is_trial()  # tried again, not yet trusted
    assert b.recovered() == 5  # a call completed: closed, down for 5 s
    assert not b.is_trial() and b.recovered() is None


def test_the_back_off_doubles_while_the_store_stays_down_up_to_its_maximum():
    clock = Clock()
    b = Breaker(5, 30, clock)
    backoffs = []
    for _ in range(5):
        backoffs.append(b.trip())
        clock.now += backoffs[-1]
    assert backoffs == [5, 10, 20, 30, 30]
    b.recovered()
    assert b.trip() == 5  # a new outage starts from the beginning
    assert b.trips == 6


def test_calls_timing_out_together_trip_once():
    clock = Clock()
    b = Breaker(5, 60, clock)
    b.trip()
    clock.now += 1
    assert b.trip() == 4  # the same outage: the back-off is not extended or doubled
    assert b.trips == 1


def test_another_process_can_hold_it_open():
    clock = Clock()
    b = Breaker(5, 60, clock)
    b.hold(12)
    assert b.is_open() and b.remaining_s() == 12
    b.hold(500)
    assert b.remaining_s() == 60  # never beyond the maximum
    clock.now += 60
    assert b.is_trial()


def test_a_back_off_of_zero_never_opens():
    b = Breaker(0, 0)
    assert b.trip() == 0 and not b.is_open() and not b.is_trial()
    b.hold(10)
    assert not b.is_open()


def test_a_maximum_below_the_back_off_is_refused():
    with pytest.raises(ValueError, match="back-off"):
        Breaker(10, 5)
