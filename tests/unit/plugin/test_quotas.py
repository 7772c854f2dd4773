"""Which quota the gateway writes for a model: config first, then default_total, then worker capacity;
the total split into nominal band seats by band_shares."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from plugin.config import ConfigError, config_from_dict
from plugin.quotas import desired_quota, write_quota
from policy.admission import Quota
from policy.types import Band
from store.scripts import quota_key


@pytest.mark.parametrize(
    ("data", "concurrencies", "total"),
    [
        pytest.param(
            {"models": {"m": {"total": 5}}, "admission": {"default_total": 9}}, [4], 5, id="model total"
        ),
        pytest.param({"admission": {"default_total": 9}}, [4], 9, id="default total"),
        pytest.param({}, [4, 4, 4], 12, id="from worker capacity"),
        pytest.param({}, [4, 0], None, id="unknown capacity: unlimited"),
        pytest.param({}, [], None, id="no workers: unlimited"),
    ],
)
def test_desired_quota(data: dict[str, object], concurrencies: list[int], total: int | None) -> None:
    quota = desired_quota(config_from_dict(data), "m", concurrencies)
    assert (quota.total if quota else None) == total


def test_requests_not_seats_by_default() -> None:
    quota = desired_quota(config_from_dict({"models": {"m": {"total": 2}}}), "m", [])
    assert quota is not None and quota.count_seats is False


async def test_write_quota_round_trip(redis: aioredis.Redis) -> None:
    await write_quota(redis, "m", Quota(total=3, count_seats=False))
    raw = {k.decode(): v.decode() for k, v in (await redis.hgetall(quota_key("m"))).items()}
    assert Quota.from_hash(raw).total == 3


H, N, L = Band.HIGH, Band.NORMAL, Band.LOW


@pytest.mark.parametrize(
    ("data", "bands"),
    [
        pytest.param({"models": {"m": {"total": 10}}}, {}, id="default: total only"),
        pytest.param(
            {
                "models": {"m": {"total": 10}},
                "admission": {"band_shares": {"high": 0.5, "normal": 0.3, "low": 0.2}},
            },
            {H: 5, N: 3, L: 2},
            id="the simulator's shares",
        ),
        pytest.param(
            {
                "models": {"m": {"total": 10}},
                "admission": {"band_shares": {"high": 0.2, "normal": 0.4, "low": 0.4}},
            },
            {H: 2, N: 4, L: 4},
            id="gateway-wide shares",
        ),
        pytest.param(
            {"models": {"m": {"total": 10, "band_shares": {"high": 1.0}}}},
            {H: 10, N: 0, L: 0},
            id="model override",
        ),
        pytest.param(
            {"models": {"m": {"total": 10, "band_shares": {}}}, "admission": {"band_shares": {"high": 1.0}}},
            {},
            id="model turns bands off",
        ),
        pytest.param(
            {"models": {"m": {"total": 3, "band_shares": {"high": 0.5, "normal": 0.3, "low": 0.2}}}},
            {H: 1, N: 1, L: 1},
            id="small total: a seat per band",
        ),
    ],
)
def test_total_is_split_into_band_shares(data: dict[str, object], bands: dict[Band, int]) -> None:
    quota = desired_quota(config_from_dict(data), "m", [])
    assert quota is not None and dict(quota.band) == bands
    assert quota.borrow.get(Band.LOW, 0) == 0  # a loan to batch work could not be recalled


@pytest.mark.parametrize(
    ("shares", "path"),
    [
        pytest.param({"urgent": 0.5}, "admission.band_shares.urgent", id="unknown band"),
        pytest.param({"high": 1.5}, "admission.band_shares.high", id="share above 1"),
        pytest.param({"high": 0.7, "low": 0.7}, "admission.band_shares", id="more than the total"),
        pytest.param({"high": "half"}, "admission.band_shares.high", id="not a number"),
    ],
)
def test_bad_band_shares_name_the_key(shares: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"admission": {"band_shares": shares}})
    assert str(info.value).startswith(f"{path}:")
