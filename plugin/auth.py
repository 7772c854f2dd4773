"""Who is asking and how urgently: tenant from the API key, priority band and wait budget from headers.

Pure functions over header values and the config, so the tables are unit-tested directly.
A request's band is what it asks for (header), else its tenant's default, clamped to the tenant's
maximum; its wait budget is the config default, lowered (never raised) by the wait header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from plugin.config import GatewayConfig, TenantSection, key_digest
from plugin.errors import GatewayError
from policy.types import Band, ascii_int

DEFAULT_TENANT = TenantSection()


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    band: Band
    max_wait_s: float  # 0 = do not queue
    ttft_slo_s: float | None = None  # the client's time-to-first-token SLO, if it sent one
    clamped: bool = False  # it asked for a band above its tenant's max_band (and got that maximum)


class Auth:
    """Resolves a request's tenant, band and wait budget from the config (built once per config)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tenant_of_key = config.key_to_tenant()
        self.tenants: Mapping[str, TenantSection] = config.tenants
        # (default band, max band) of each tenant's section, parsed once (the config checked them)
        self._bands = {name: _bands_of(section) for name, section in self.tenants.items()}
        self._default_bands = _bands_of(DEFAULT_TENANT)
        p = config.priority  # header names as a request's HeaderMap holds them (plugin/intake.py)
        self._headers = (p.header.lower(), p.wait_header.lower(), p.slo_header.lower())

    def tenant(self, authorization: str | None) -> str:
        """Tenant of an Authorization header value; GatewayError 401 when auth is on and it is unknown."""
        key = bearer_token(authorization)
        if key is not None and (tenant := self.tenant_of_key.get(key_digest(key))) is not None:
            return tenant
        if self.config.auth.enabled:
            if key is None:
                raise GatewayError(401, "missing_api_key", "send an API key as 'Authorization: Bearer <key>'")
            raise GatewayError(401, "invalid_api_key", "unknown API key")
        return self.config.auth.default_tenant

    def band(self, tenant: str, header_value: str | None, *, clamp: bool = True) -> Band:
        """The band asked for (else the tenant's default), clamped to the tenant's maximum; 400 if bad."""
        default, most = self._bands.get(tenant, self._default_bands)
        if header_value is None or not header_value.strip():
            asked = default
        else:
            try:
                asked = Band.parse(header_value)
            except ValueError as e:
                raise GatewayError(400, "invalid_priority", f"{self.config.priority.header}: {e}") from None
        return min(asked, most) if clamp else asked

    def max_wait_s(self, header_value: str | None) -> float:
        """Queue wait budget in seconds: the config default, or the header's value if lower (0 = no wait)."""
        default_ms = self.config.admission.max_wait_ms
        asked_ms = header_ms(header_value, self.config.priority.wait_header, "invalid_wait_budget", minimum=0)
        return default_ms / 1000 if asked_ms is None else min(asked_ms, default_ms) / 1000

    def ttft_slo_s(self, header_value: str | None) -> float | None:
        """The TTFT SLO header in seconds (None when absent); 400 unless positive integer ms."""
        slo_ms = header_ms(header_value, self.config.priority.slo_header, "invalid_ttft_slo", minimum=1)
        return None if slo_ms is None else slo_ms / 1000

    def caller(self, headers: Mapping[str, str]) -> Caller:
        tenant = self.tenant(headers.get("authorization"))
        priority, wait, slo = self._headers
        wanted = self.band(tenant, headers.get(priority), clamp=False)
        band = min(wanted, self._bands.get(tenant, self._default_bands)[1])  # clamped to its max band
        return Caller(
            tenant=tenant,
            band=band,
            clamped=band < wanted,
            max_wait_s=self.max_wait_s(headers.get(wait)),
            ttft_slo_s=self.ttft_slo_s(headers.get(slo)),
        )


def _bands_of(section: TenantSection) -> tuple[Band, Band]:
    return Band.parse(section.default_band), Band.parse(section.max_band)


def header_ms(value: str | None, header: str, code: str, *, minimum: int) -> int | None:
    """A header of integer milliseconds >= `minimum`; None when absent or blank; else 400 `code`."""
    if value is None or not value.strip():
        return None
    try:
        ms = ascii_int(value.strip())
    except ValueError:
        raise GatewayError(400, code, f"{header} must be integer milliseconds") from None
    if ms < minimum:
        raise GatewayError(400, code, f"{header} must be >= {minimum}")
    return ms


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
