"""policy.liveness: the one renewal rule of agents and static workers."""

from __future__ import annotations

import pytest

from policy.liveness import Liveness, ProbeOutcome

OK, SLOW, FAILED, REFUSED = ProbeOutcome.HEALTHY, ProbeOutcome.SLOW, ProbeOutcome.FAILED, ProbeOutcome.REFUSED


def renewals(liveness: Liveness, outcomes: list[ProbeOutcome]) -> list[bool]:
    return [liveness.observe(o) for o in outcomes]


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Liveness(fail_periods=0)
    with pytest.raises(ValueError, match=">= 1"):
        Liveness(slow_periods=0)


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        pytest.param([FAILED] * 4, [True, True, False, False], id="errors end renewal at fail_periods"),
        pytest.param([SLOW] * 6, [True] * 4 + [False] * 2, id="timeouts end renewal at slow_periods"),
        pytest.param([REFUSED], [False], id="a refused connection ends renewal at once"),
        pytest.param(
            [FAILED, FAILED, OK, FAILED, FAILED], [True] * 5, id="a healthy answer forgets failures"
        ),
        pytest.param([SLOW, SLOW, FAILED], [True, True, False], id="mixed failures count together"),
        pytest.param([REFUSED, SLOW, OK], [False, False, True], id="ended until a healthy answer"),
    ],
)
def test_renewal(outcomes: list[ProbeOutcome], expected: list[bool]) -> None:
    assert renewals(Liveness(fail_periods=3, slow_periods=5), outcomes) == expected
