"""`python -m bench.sim.gate_settings`: SETTING strings become kvgate gates; bad ones fail before any run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.sim.admission import KvgateGate
from bench.sim.gate_settings import main, make_gate
from bench.sim.profiles import load_profile
from policy.admission import DEFAULT_SHARES, default_quota
from policy.types import Band

PROFILE = load_profile("h100-llama3.1-8b")


@pytest.mark.parametrize(
    ("setting", "check"),
    [
        pytest.param(
            "default", lambda g: g.quota == default_quota(8, PROFILE.capacity_tokens // 4096), id="default"
        ),
        pytest.param(
            "tokens_per_seat=512,max_seats=64",
            lambda g: (g.config.tokens_per_seat, g.config.max_seats, g.quota.total) == (512, 64, 8 * 852),
            id="seat size",
        ),
        pytest.param("seats_per_worker=50", lambda g: g.quota.total == 400, id="seats per worker"),
        pytest.param(
            "shares=0.2/0.6/0.2",
            lambda g: (
                g.config.shares == {Band.HIGH: 0.2, Band.NORMAL: 0.6, Band.LOW: 0.2}
                and g.config.shares != DEFAULT_SHARES
            ),
            id="shares",
        ),
        pytest.param(
            "shed_low_after_s=none", lambda g: g.config.shed_low_after_s is None, id="no low shedding"
        ),
        pytest.param("reserve=0.1", lambda g: g.quota.reserve == {Band.HIGH: 84}, id="reserve for high"),
    ],
)
def test_settings_become_gates(setting: str, check: Callable[[KvgateGate], bool]) -> None:
    assert check(make_gate(setting, PROFILE, 8))


def test_a_bad_setting_fails_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["default", "seat=3"]) == 2
    assert "unknown gate setting 'seat=3'" in capsys.readouterr().err
