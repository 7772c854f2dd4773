"""Tenant from the API key, priority band clamped per tenant, wait budget from the header."""

from __future__ import annotations

import pytest
from mitmproxy import http

from plugin.auth import Auth, bearer_token
from plugin.config import config_from_dict
from plugin.errors import GatewayError
from plugin.intake import HeaderMap
from policy.types import Band

TENANTS = {
    "gold": {"api_keys": ["k-gold"], "max_band": "high"},
    "batch": {"api_keys": ["k-batch"], "max_band": "low", "default_band": "low"},
}
OPEN = Auth(config_from_dict({"tenants": TENANTS, "admission": {"max_wait_ms": 5000}}))
CLOSED = Auth(config_from_dict({"tenants": TENANTS, "auth": {"enabled": True}}))


@pytest.mark.parametrize(
    ("auth", "header", "tenant"),
    [
        pytest.param(OPEN, "Bearer k-gold", "gold", id="known key"),
        pytest.param(OPEN, "bearer  k-batch ", "batch", id="case and spaces"),
        pytest.param(OPEN, None, "default", id="auth off, no key: default tenant"),
        pytest.param(OPEN, "Bearer nope", "default", id="auth off, unknown key: default tenant"),
        pytest.param(CLOSED, "Bearer k-gold", "gold", id="auth on, known key"),
    ],
)
def test_tenant(auth: Auth, header: str | None, tenant: str) -> None:
    assert auth.tenant(header) == tenant


@pytest.mark.parametrize(
    ("header", "code"),
    [(None, "missing_api_key"), ("Bearer nope", "invalid_api_key"), ("Basic k-gold", "missing_api_key")],
    ids=["no key", "unknown key", "not a bearer key"],
)
def test_auth_on_rejects(header: str | None, code: str) -> None:
    with pytest.raises(GatewayError) as info:
        CLOSED.tenant(header)
    assert (info.value.status, info.value.code) == (401, code)


@pytest.mark.parametrize(
    ("tenant", "header", "band"),
    [
        pytest.param("gold", "high", Band.HIGH, id="high allowed"),
        pytest.param("gold", None, Band.NORMAL, id="no header: tenant default"),
        pytest.param("gold", "5", Band.HIGH, id="positive integer is high"),
        pytest.param("gold", "-1", Band.LOW, id="negative integer is low"),
        pytest.param("batch", "high", Band.LOW, id="clamped to the tenant's max"),
        pytest.param("batch", None, Band.LOW, id="tenant default low"),
        pytest.param("default", "LOW", Band.LOW, id="unknown tenant, any case"),
    ],
)
def test_band(tenant: str, header: str | None, band: Band) -> None:
    assert OPEN.band(tenant, header) is band


def test_bad_priority_is_400() -> None:
    with pytest.raises(GatewayError) as info:
        OPEN.band("gold", "urgent")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, 5.0), ("0", 0.0), ("250", 0.25), ("999999", 5.0)],
    ids=["default", "zero means no wait", "lowered", "never raised above the config"],
)
def test_wait_budget(header: str | None, seconds: float) -> None:
    assert OPEN.max_wait_s(header) == seconds


@pytest.mark.parametrize("header", ["soon", "-5", "1.5"])
def test_bad_wait_budget_is_400(header: str) -> None:
    with pytest.raises(GatewayError) as info:
        OPEN.max_wait_s(header)
    assert info.value.status == 400


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("Bearer ") is None
    assert bearer_token("") is None


def test_api_keys_may_be_stored_hashed() -> None:
    import hashlib

    from plugin.auth import Auth
    from plugin.config import config_from_dict

    digest = hashlib.sha256(b"tenant-key").hexdigest()
    config = config_from_dict(
        {"auth": {"enabled": True}, "tenants": {"acme": {"api_keys": [f"sha256:{digest}"]}}}
    )
    auth = Auth(config)
    assert auth.tenant("Bearer tenant-key") == "acme"
    assert "tenant-key" not in repr(auth.tenant_of_key)  # only digests are kept in memory


def test_a_clamped_priority_is_flagged() -> None:
    from plugin.auth import Auth
    from plugin.config import config_from_dict

    auth = Auth(config_from_dict({"tenants": {"default": {"max_band": "normal"}}}))
    assert auth.caller({"x-kvgate-priority": "high"}).clamped is True
    assert auth.caller({"x-kvgate-priority": "low"}).clamped is False


def test_a_non_utf8_api_key_is_a_401_not_a_crash() -> None:
    from plugin.auth import Auth
    from plugin.config import config_from_dict
    from plugin.errors import GatewayError

    auth = Auth(config_from_dict({"auth": {"enabled": True}, "tenants": {"a": {"api_keys": ["k"]}}}))
    try:
        auth.tenant("Bearer \udc80")  # a latin-1 byte, as HeaderMap decodes it
    except GatewayError as e:
        assert e.status == 401
    else:
        raise AssertionError("an unknown key must be refused")


def test_configured_header_names_match_in_any_case() -> None:
    """A request's headers are looked up lower-cased (plugin/intake.py HeaderMap), so header names the
    config spells in capitals still match, whatever case the client sends."""
    auth = Auth(
        config_from_dict(
            {
                "tenants": TENANTS,
                "priority": {"header": "X-Prio", "wait_header": "X-Wait-MS", "slo_header": "X-SLO"},
            }
        )
    )
    fields = [
        (b"AUTHORIZATION", b"Bearer k-gold"),
        (b"x-prio", b"low"),
        (b"X-WAIT-ms", b"250"),
        (b"x-Slo", b"90"),
    ]
    caller = auth.caller(HeaderMap.of(http.Headers(fields)))
    assert (caller.tenant, caller.band, caller.max_wait_s, caller.ttft_slo_s) == (
        "gold",
        Band.LOW,
        0.25,
        0.09,
    )
