"""The capacity search of scripts/bench_goodput.py (scripts/capacity.py): the highest rate with 90% of
requests within both SLOs, by bracketing and bisection."""

import pytest

from scripts.capacity import capacity


def test_it_finds_each_thresholds_crossing_and_shares_evaluations():
    calls = []

    def share_within(rate):  # falls with the rate: 90% within at 3.0 for 0.1 s, 5.0 for 0.2, never short for 0.3
        calls.append(rate)
        return {"0.1": 1.0 - rate / 30, "0.2": 1.0 - rate / 50, "0.3": 1.0}

    found = capacity(share_within, steps=8)
    assert found["0.1"]["rate"] == pytest.approx(3.0, rel=0.02) and found["0.1"]["bound"] == "bisected"
    assert found["0.2"]["rate"] == pytest.approx(5.0, rel=0.02)
    assert found["0.3"]["bound"] == "at_least" and found["0.3"]["rate"] >= 64
    assert len(calls) == len(set(calls))  # no rate run twice


def test_a_system_short_of_the_slo_at_every_rate_reports_below():
    found = capacity(lambda rate: {"0.1": 0.5}, thresholds=(0.1,))
    assert found["0.1"] == {"rate": 0.0, "bound": "below", "evaluated": found["0.1"]["evaluated"]}


def test_a_search_started_near_the_crossing_needs_few_runs():
    calls = []

    def share_within(rate):
        calls.append(rate)
        return {"0.1": 1.0 - rate / 30}

    found = capacity(share_within, thresholds=(0.1,), start={"0.1": 2.9}, steps=2)
    assert found["0.1"]["rate"] == pytest.approx(3.0, rel=0.2) and len(calls) == 4  # 2.9 holds, 5.8 not, 2 steps
