"""policy/pressure.py: low priority is shed only after the higher bands have waited continuously."""

from __future__ import annotations

import pytest

from policy.pressure import PressureTracker, waiting_above_low
from policy.types import Band

QUIET = {Band.HIGH: 0, Band.NORMAL: 0, Band.LOW: 7}
HIGH_WAITING = {Band.HIGH: 1, Band.NORMAL: 0, Band.LOW: 0}
NORMAL_WAITING = {Band.HIGH: 0, Band.NORMAL: 3, Band.LOW: 0}


@pytest.mark.parametrize(
    ("queued", "expected"),
    [
        pytest.param(QUIET, False, id="only low waits"),
        pytest.param(HIGH_WAITING, True, id="high waits"),
        pytest.param(NORMAL_WAITING, True, id="normal waits"),
        pytest.param({}, False, id="nothing known"),
    ],
)
def test_waiting_above_low(queued: dict[Band, int], expected: bool) -> None:
    assert waiting_above_low(queued) is expected


@pytest.mark.parametrize(
    ("observations", "ask_at", "band", "after_s", "sheds"),
    [
        pytest.param([(0.0, HIGH_WAITING), (4.0, NORMAL_WAITING)], 5.0, Band.LOW, 5.0, True, id="sustained"),
        pytest.param([(0.0, HIGH_WAITING)], 4.9, Band.LOW, 5.0, False, id="not yet"),
        pytest.param([(0.0, HIGH_WAITING), (3.0, QUIET), (4.0, HIGH_WAITING)], 8.0, Band.LOW, 5.0, False,
                     id="a quiet moment restarts the clock"),
        pytest.param([(0.0, HIGH_WAITING)], 60.0, Band.NORMAL, 5.0, False, id="only low is shed"),
        pytest.param([(0.0, HIGH_WAITING)], 60.0, Band.LOW, 0.0, False, id="0 turns shedding off"),
        pytest.param([(0.0, QUIET)], 60.0, Band.LOW, 5.0, False, id="low waiting alone is no pressure"),
    ],
)  # fmt: skip
def test_sheds(
    observations: list[tuple[float, dict[Band, int]]], ask_at: float, band: Band, after_s: float, sheds: bool
) -> None:
    tracker = PressureTracker()
    for at, queued in observations:
        tracker.observe("m", queued, at)
    assert tracker.sheds("m", band, ask_at, after_s) is sheds
    assert tracker.sheds("other-model", band, ask_at, after_s) is False  # per model


def test_pressure_ends_when_the_higher_queues_empty() -> None:
    tracker = PressureTracker()
    tracker.observe("m", HIGH_WAITING, 0.0)
    assert tracker.pressure_s("m", 10.0) == 10.0
    tracker.observe("m", QUIET, 11.0)
    assert tracker.pressure_s("m", 12.0) == 0.0
