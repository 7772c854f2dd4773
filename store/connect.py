"""One way to open the shared Redis from a URL: plain `redis://`, TLS `rediss://`, a unix socket, or
Sentinel: `sentinel://host:port[,host:port...]/<service>[?db=N]` (the client asks the sentinels
for the current primary and follows a failover: redis-py's SentinelConnectionPool)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel


def redis_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
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
    sentinel_kwargs = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **sentinel_kwargs)  # type: ignore[no-untyped-call]
    primary: aioredis.Redis = sentinel.master_for(service, redis_class=aioredis.Redis, db=db, **kwargs)
    return primary
