"""Prometheus text exposition, through prometheus-client, of metric families built at scrape time.

The agent and the emulated worker read their figures from live objects when scraped, so they build
`prometheus_client.core` metric families then rather than keep registered metrics up to date;
`text_of` renders them with prometheus-client's own writer (escaping, `_total`, bucket lines).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def text_of(families: Iterable[Metric]) -> str:
    """The Prometheus text format (0.0.4) of `families`, in their order."""
    return generate_latest(_Families(families)).decode()
