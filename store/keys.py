"""Redis key names, in one place for the addon, the agent and the tests.

Every key of one model shares the hash tag `{model}`, so each Lua script touches one slot and the
same code runs on Redis Cluster. The layout is documented in docs/REDIS.md.
"""

from __future__ import annotations

PREFIX = "kvg"


def model_key(model: str, *parts: str) -> str:
    """`kvg:{<model>}:<part>:<part>...`"""
    if "{" in model or "}" in model:
        raise ValueError(f"model name may not contain braces: {model!r}")
    return ":".join((PREFIX, "{" + model + "}", *parts))


def workers(model: str) -> str:
    """ZSET worker id -> lease expiry (ms). A worker whose score is in the past gets no traffic."""
    return model_key(model, "workers")


def worker(model: str, worker_id: str) -> str:
    """HASH of one worker's registration and latest load (see docs/REDIS.md)."""
    return model_key(model, "worker", worker_id)


def models() -> str:
    """SET of model names that have at least one registered worker (not hash-tagged: read only)."""
    return f"{PREFIX}:models"
