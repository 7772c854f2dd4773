"""The Prometheus text the gateway exports parses line by line and counts what was observed."""

from __future__ import annotations

from plugin.metrics import GatewayMetrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_render() -> None:
    m = GatewayMetrics()
    m.requests.inc("llama", "high", "200")
    m.requests.inc("llama", "high", "200")
    m.ttft.observe(0.03, "llama")
    m.ttft.observe(7.0, "llama")
    m.routed.inc("llama", 'w"1', "prefix")
    text = m.render()
    got = samples(text)
    assert got['kvgate_requests_total{model="llama",band="high",status="200"}'] == 2
    assert got['kvgate_ttft_seconds_bucket{model="llama",le="0.05"}'] == 1
    assert got['kvgate_ttft_seconds_bucket{model="llama",le="+Inf"}'] == 2
    assert got['kvgate_ttft_seconds_count{model="llama"}'] == 2
    assert got['kvgate_routing_decisions_total{model="llama",worker="w\\"1",kind="prefix"}'] == 1
    assert "# TYPE kvgate_ttft_seconds histogram" in text
