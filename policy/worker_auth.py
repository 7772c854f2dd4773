"""Signed worker registrations: who may put a worker URL in front of tenants' prompts and keys.

With a shared secret (`KVGATE_WORKER_SECRET`, or the gateway's `[workers] secret`), a node agent
signs its registration and every heartbeat with HMAC-SHA256 over the model, worker id, URL, epoch
source fields and time; a gateway routes only to workers whose registration signature is valid and
whose latest heartbeat signature is valid and fresh (not older than the lease). Someone who can
write to Redis but has no secret cannot add a worker or point an existing id at another URL: a
replayed signature names the real worker's own URL, and goes stale within one lease.

Pure functions (no I/O, no clock): the caller passes the times.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

SECRET_ENV = "KVGATE_WORKER_SECRET"
REGISTRATION_FIELD = "reg_sig"
HEARTBEAT_FIELD = "hb_sig"


def secret_from_env(environ: Mapping[str, str] = os.environ) -> bytes:
    """The shared worker secret from the environment (b"" = the worker plane is not authenticated)."""
    return environ.get(SECRET_ENV, "").encode()


def _mac(secret: bytes, *parts: object) -> str:
    message = "\n".join(str(p) for p in parts).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def registration_signature(
    secret: bytes, model: str, worker_id: str, url: str, max_concurrency: int, joined_ms: int
) -> str:
    return _mac(secret, "kvgate-register-v1", model, worker_id, url, max_concurrency, joined_ms)


def heartbeat_signature(secret: bytes, model: str, worker_id: str, url: str, updated_ms: int) -> str:
    return _mac(secret, "kvgate-heartbeat-v1", model, worker_id, url, updated_ms)


def verify_worker(
    secret: bytes,
    model: str,
    worker_id: str,
    fields: Mapping[str, str],
    *,
    now_ms: int,
    max_age_ms: int,
) -> str:
    """ "" if the stored worker record is properly signed and its heartbeat fresh, else why not."""

    def num(name: str) -> int:
        try:
            return int(float(fields.get(name, "0") or 0))
        except ValueError:
            return -1

    url = fields.get("url", "")
    reg = registration_signature(secret, model, worker_id, url, num("max_concurrency"), num("joined_ms"))
    if not hmac.compare_digest(reg, fields.get(REGISTRATION_FIELD, "")):
        return "registration not signed with the worker secret"
    updated = num("updated_ms")
    hb = heartbeat_signature(secret, model, worker_id, url, updated)
    if not hmac.compare_digest(hb, fields.get(HEARTBEAT_FIELD, "")):
        return "heartbeat not signed with the worker secret"
    if updated < now_ms - max_age_ms:
        return f"signed heartbeat is {now_ms - updated} ms old"
    return ""
