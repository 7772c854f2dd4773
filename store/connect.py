"""One way to open the shared Redis from a URL: plain `redis://`, TLS `rediss://`, a unix socket,
Sentinel: `sentinel://host:port[,host:port...]/<service>[?db=N]` (the client asks the sentinels
for the current primary and follows a failover: redis-py's SentinelConnectionPool), or Redis Cluster:
`redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` for TLS; any node
will do, the client discovers the rest and follows MOVED/ASK: redis-py's RedisCluster)."""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.maint_notifications import MaintNotificationsConfig

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def redacted(url: str) -> str:
    """`url` with its password replaced by `***`: fit for a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    return parts._replace(netloc=netloc).geturl()


def redis_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    if is_cluster_url(url):
        return cluster_from_url(url, **kwargs)
    if not url.startswith("sentinel://"):
        return aioredis.Redis.from_url(url, **kwargs)
    parts = urlsplit(url)
    hosts = []
    for item in parts.netloc.split(","):
        host, _, port = item.rpartition(":")
        hosts.append((host or "127.0.0.1", int(port or 26379)))
    service = parts.path.strip("/")
    if not service:
        raise ValueError(f"sentinel URL without a service name: {url!r}")
    db = int(parse_qs(parts.query).get("db", ["0"])[0])
    sentinel_kwargs: dict[str, Any] = {
        k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs
    }
    # redis-py < 8.2 leaves Sentinel's __init__ unannotated; 8.2 types it
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    primary: aioredis.Redis = sentinel.master_for(service, redis_class=aioredis.Redis, db=db, **kwargs)
    return primary


def cluster_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """A RedisCluster client for `redis+cluster://...`. It is typed as `aioredis.Redis` because kvgate
    calls only commands both clients have (single-slot scripts, pipelines, pub/sub, XREAD: the key
    layout keeps every multi-key command in one slot, docs/REDIS.md); the e2e suite runs on both."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        nodes.append(ClusterNode(host or "127.0.0.1", int(port or 6379)))
    if not nodes:
        raise ValueError(f"cluster URL without a node: {url!r}")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0: {url!r}")
    if parts.username:
        kwargs.setdefault("username", unquote(parts.username))
    if parts.password:
        kwargs.setdefault("password", unquote(parts.password))
    if url.startswith("rediss+"):
        kwargs.setdefault("ssl", True)
    kwargs.pop("db", None)
    # redis-py 8 sends CLIENT MAINT_NOTIFICATIONS on each new connection when "auto"; Redis 6.2 knows no
    # such command (kvgate needs no maintenance push notifications): off
    kwargs.setdefault("maint_notifications_config", MaintNotificationsConfig(enabled=False))
    # redis-py's default (5) closes every connection of the client (`aclose()`) on every fifth MOVED,
    # under the tasks still using them: at 16+ commands in flight they fail with ConnectionError and,
    # on CPython 3.13.0, `TypeError: 'NoneType' object is not callable` (a write on a transport it
    # closed; redis-py 8.1.0, the newest release, lets it escape). 0: a MOVED only updates that slot's
    # owner from the reply (a real reshard still converges); a connection error still reloads the map.
    # tests/e2e/test_cluster_concurrency.py, docs/REDIS.md
    kwargs.setdefault("reinitialize_steps", 0)
    return cast(aioredis.Redis, RedisCluster(startup_nodes=nodes, **kwargs))


async def ready(redis: aioredis.Redis) -> None:
    """Make a cluster client learn the slot map now: redis-py does it on the first command, but not
    for the first command of a pub/sub object made from it. Nothing for other clients."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()


def is_cluster(redis: aioredis.Redis) -> bool:
    return isinstance(redis, RedisCluster)
