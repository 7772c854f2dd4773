"""Which quota the gateway writes for a model: config first, then default_total, then worker capacity."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from plugin.config import config_from_dict
from plugin.quotas import desired_quota, write_quota
from plugin.scripts import quota_key
from policy.admission import Quota


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
