"""`redis+cluster://` URLs open a RedisCluster with every listed startup node (no connection is made)."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from store.connect import is_cluster, redis_from_url


def test_a_cluster_url_lists_its_nodes_and_credentials() -> None:
    client = redis_from_url("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001", socket_timeout=2)
    assert isinstance(client, RedisCluster) and is_cluster(client)
    assert sorted(n.name for n in client.nodes_manager.startup_nodes.values()) == [
        "10.0.0.1:7000",
        "10.0.0.2:7001",
    ]
    kwargs = client.nodes_manager.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["socket_timeout"]) == ("u", "p@ss", 2)


def test_a_cluster_has_only_database_zero() -> None:
    with pytest.raises(ValueError, match="database 0"):
        redis_from_url("redis+cluster://127.0.0.1:7000/3")


def test_plain_urls_stay_standalone() -> None:
    assert not is_cluster(redis_from_url("redis://127.0.0.1:6379/0"))


def test_redacted_hides_only_the_password() -> None:
    from store.connect import redacted

    assert redacted("rediss://kvgate:s3cret@host:6380/0?ssl_ca_certs=/ca.pem") == (
        "rediss://kvgate:***@host:6380/0?ssl_ca_certs=/ca.pem"
    )
    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"
    assert redacted("redis+cluster://u:p@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
