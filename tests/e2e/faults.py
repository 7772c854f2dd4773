"""Fault injection for end-to-end tests: real processes, real signals (issue 10's failure list).

- `RedisProcess`: a redis-server on a fixed loopback port that can be killed with SIGKILL, restarted
  on the same port (empty: the chart's bundled Redis keeps no data), or paused with SIGSTOP;
- `stream()`: one streaming completion through a gateway, with its status, first bytes and errors;
- `children_named()`: the processes a process started (to check an embedded redis-server is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from store.redis_server import EmbeddedRedis, free_port


class RedisProcess:
    """A redis-server whose faults a test injects; always on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: EmbeddedRedis | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.server = EmbeddedRedis(self.port).start()
        return self

    def kill(self) -> None:
        """SIGKILL: every key is gone with it."""
        assert self.server is not None and self.server.pid is not None
        os.kill(self.server.pid, signal.SIGKILL)
        self.server.stop()  # reaps it and removes its directory
        self.server = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.server is not None and self.server.pid is not None
        os.kill(self.server.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.server is not None and self.server.pid is not None
        os.kill(self.server.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server.pid or 0, signal.SIGCONT)
            self.server.stop()
            self.server = None


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""  # the client's exception, if the exchange broke


async def send(
    url: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None, timeout_s: float = 30.0
) -> Answer:
    """One request; a broken exchange is an Answer with status 0 and the error, never an exception."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(
                f"{url}/v1/chat/completions", data=data,
                headers={"content-type": "application/json", **(headers or {})},
            ) as resp,
        ):  # fmt: skip
            return Answer(resp.status, dict(resp.headers), await resp.read())
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return Answer(0, error=f"{type(e).__name__}: {e}")


def children_named(pid: int, name: str) -> list[int]:
    """Pids of `pid`'s direct children whose command is `name` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == pid and comm.startswith(name):
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


async def settle(seconds: float) -> None:
    """Let background loops run (used only to show that something does NOT happen)."""
    await asyncio.sleep(seconds)
