import pytest
import redis

from store.redis_server import EmbeddedRedis, RedisServerError


def test_embedded_redis_starts_answers_and_stops() -> None:
    server = EmbeddedRedis().start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert int(client.info("server")["redis_version"].split(".")[0]) >= 6
        client.close()
    finally:
        server.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()


def test_a_binary_that_is_not_redis_fails_with_its_exit_code() -> None:
    with pytest.raises(RedisServerError, match="exited"):
        EmbeddedRedis(binary="false").start(timeout_s=2)


async def test_shared_fixture_gives_a_clean_database(redis) -> None:
    assert await redis.dbsize() == 0
    await redis.set("k", "v")
    assert await redis.get("k") == b"v"
