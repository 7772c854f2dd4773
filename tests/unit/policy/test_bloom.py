"""policy/bloom.py: sizing, no false negatives, a false-positive rate near the chosen one."""

from __future__ import annotations

import pytest

from policy.bloom import BloomSummary, bloom_bits


def test_members_are_always_found_and_strangers_rarely() -> None:
    members = list(range(0, 20_000, 2))
    summary = BloomSummary.of(members, 0.01)
    assert all(h in summary for h in members)
    strangers = range(1, 200_001, 2)
    fp = sum(h in summary for h in strangers) / len(strangers)
    assert 0.002 < fp < 0.03, fp
    assert summary.size_bytes == pytest.approx(10_000 * 9.59 / 8, rel=0.01)  # ~9.6 bits per member at 1 %


def test_match_stops_at_the_first_miss() -> None:
    summary = BloomSummary.of([10, 11, 12], 0.001)
    assert summary.match([10, 11, 12, 99_999_999]) == 3
    assert summary.match([99_999_999, 10]) == 0


def test_bad_rate() -> None:
    with pytest.raises(ValueError, match="fp_rate"):
        bloom_bits(10, 1.0)
