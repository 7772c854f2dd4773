"""The kvgate Grafana dashboard, generated from code (grafana-foundation-sdk, Grafana's own builder).

    python -m bench.dashboard            # rewrite the shipped copies
    python -m bench.dashboard --check    # exit 1 if a shipped copy differs from the generated one
    python -m bench.dashboard --stdout   # print the JSON

The panels are built only on metrics the gateway (plugin/metrics.py) and the node agent
(agent/app.py `metrics_text`) export, with the article's five core views first: token-weighted
prefix hit rate, TTFT p50/p99, per-worker utilization spread, throughput and queue wait; then routing
(hit/miss per worker, share of traffic), admission outcomes and fleet state. Every query is evaluated
against a real Prometheus scraping a loaded stack in tests/e2e/test_dashboard.py.

Queries use two dashboard variables, `$model` (a regex, `.*` for all) and `$__rate_interval`
(Grafana's rate window); `queries()` lists every panel query for tests and operators.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parents[1]
# the chart reads its copy with .Files.Get (only files inside the chart), the other is for plain Grafana
SHIPPED = (
    ROOT / "helm" / "kvgate" / "dashboards" / "kvgate.json",
    ROOT / "examples" / "grafana-dashboard.json",
)
UID = "kvgate-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
M = 'model=~"$model"'  # every gateway metric carries the model label
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{{{M}}}{RATE})))"


def routed(selector: str = "") -> str:
    extra = f",{selector}" if selector else ""
    return f"sum by (worker) (rate(kvgate_routing_decisions_total{{{M}{extra}}}{RATE}))"


# a worker with routed traffic but no hit yet shows 0, not a gap
HITS = routed('kind="hit"')
ROUTED_BY_ARM = f"sum by (arm) (rate(kvgate_routing_decisions_total{{{M}}}{RATE}))"

ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Core views", (
        PanelSpec(
            "Prefix cache hit rate (token-weighted)",
            "Prompt tokens the workers served from their prefix cache, over all prompt tokens (the usage "
            "the workers report). Token-weighted: a long prompt counts more than a short one.",
            (Query(f"sum(rate(kvgate_cached_tokens_total{{{M}}}{RATE})) / "
                   f"sum(rate(kvgate_prompt_tokens_total{{{M}}}{RATE}))", "hit rate"),),
            unit="percentunit", kind="stat", width=6,
        ),
        PanelSpec(
            "Time to first token p50 / p99",
            "Measured by the gateway from request arrival to the first streamed token (includes queue wait).",
            (Query(quantile(0.5, "kvgate_ttft_seconds"), "p50"),
             Query(quantile(0.99, "kvgate_ttft_seconds"), "p99")),
            unit="s", width=18,
        ),
        PanelSpec(
            "Worker utilization spread (CV of running requests)",
            "Coefficient of variation of the requests each worker ran over the window (agents' scrape "
            "of the engine): 0 = perfectly even, above 0.5 = a few workers carry the load.",
            (Query("stddev(avg_over_time(kvgate_agent_worker_running" + RATE + ")) / "
                   "avg(avg_over_time(kvgate_agent_worker_running" + RATE + "))", "CV"),),
            kind="stat", width=6,
        ),
        PanelSpec(
            "Running requests per worker",
            "Requests each engine runs (agent scrape of vLLM/SGLang /metrics).",
            (Query("max by (worker) (kvgate_agent_worker_running)", "{{worker}}"),),
            width=9,
        ),
        PanelSpec(
            "KV-cache usage per worker",
            "Fraction of each engine's KV cache in use (agent scrape).",
            (Query("max by (worker) (kvgate_agent_worker_kv_usage)", "{{worker}}"),),
            unit="percentunit", width=9,
        ),
        PanelSpec(
            "Throughput",
            "Completed requests per second (HTTP 200) and output tokens per second, all gateways.",
            (Query(f'sum(rate(kvgate_requests_total{{{M},status="200"}}{RATE}))', "requests/s"),
             Query(f"sum(rate(kvgate_output_tokens_total{{{M}}}{RATE}))", "output tokens/s")),
            width=12,
        ),
        PanelSpec(
            "Queue wait p50 / p99 and expected wait",
            "Time admitted requests waited for a slot in the global queue, and the expected wait of a "
            "request arriving now (the autoscaling signal, kvgate_expected_queue_wait_seconds).",
            (Query(quantile(0.5, "kvgate_admission_wait_seconds"), "p50"),
             Query(quantile(0.99, "kvgate_admission_wait_seconds"), "p99"),
             Query(f"max by (model) (kvgate_expected_queue_wait_seconds{{{M}}})", "expected {{model}}")),
            unit="s", width=12,
        ),
    )),
    ("Routing", (
        PanelSpec(
            "Routing decisions by kind",
            "Requests routed to a worker that held part of their prefix (hit) or to none (miss).",
            (Query(f"sum by (kind) (rate(kvgate_routing_decisions_total{{{M}}}{RATE}))", "{{kind}}"),),
            unit="reqps", width=8,
        ),
        PanelSpec(
            "Prefix hit share per worker",
            "Of the requests routed to each worker, the share routed there for a prefix hit.",
            (Query(f"({HITS} or 0 * {routed()}) / {routed()}", "{{worker}}"),),
            unit="percentunit", width=8,
        ),
        PanelSpec(
            "Share of traffic per worker",
            "Routing decisions per second, by worker.",
            (Query(routed(), "{{worker}}"),),
            unit="reqps", width=8,
        ),
        PanelSpec(
            "Routing reasons",
            "Why the policy chose its worker (policy.types.ReasonKind): cache_hit, load, stickiness, "
            "exploration, replica_cap, session, fallback; and which index matched.",
            (Query(f"sum by (reason, index) (rate(kvgate_routing_reasons_total{{{M}}}{RATE}))",
                   "{{reason}} ({{index}})"),),
            unit="reqps", width=8,
        ),
        PanelSpec(
            "Prefix switches by arm",
            "Share of routed requests sent to another worker than their prefix's previous request "
            "(a switch costs that prefix's recompute there), per A/B arm.",
            (Query(f"(sum by (arm) (rate(kvgate_prefix_switches_total{{{M}}}{RATE})) or {ROUTED_BY_ARM} * 0)"
                   f" / {ROUTED_BY_ARM}", "{{arm}}"),),
            unit="percentunit", width=8,
        ),
        PanelSpec(
            "Hot-path CPU per stage",
            "Mean CPU per run of each gateway stage (parse, hash, route, admit, release) on the event "
            "loop: where a saturated gateway spends its time.",
            (Query(f"sum by (stage) (rate(kvgate_hot_path_cpu_seconds_sum{{{M}}}{RATE})) / "
                   f"sum by (stage) (rate(kvgate_hot_path_cpu_seconds_count{{{M}}}{RATE}))", "{{stage}}"),),
            unit="s", width=8,
        ),
    )),
    ("Admission", (
        PanelSpec(
            "Outcomes by status",
            "Finished requests per second by HTTP status (429 = refused by admission, 503 = no worker).",
            (Query(f"sum by (status) (rate(kvgate_requests_total{{{M}}}{RATE}))", "{{status}}"),),
            unit="reqps", width=8,
        ),
        PanelSpec(
            "Admission rejections by reason",
            "quota / wait_budget / queue_full / shed / slo_unreachable / client_gone, per second.",
            (Query(f"sum by (reason) (rate(kvgate_admission_rejected_total{{{M}}}{RATE}))", "{{reason}}"),),
            unit="reqps", width=8,
        ),
        PanelSpec(
            "Seats used and queued",
            "Seats held by live leases of all gateways, and requests waiting in the global queue per band.",
            (Query(f"max by (model) (kvgate_seats_used{{{M}}})", "used {{model}}"),
             Query(f"max by (band) (kvgate_global_queue_length{{{M}}})", "queued {{band}}")),
            width=8,
        ),
        PanelSpec(
            "Workers by state",
            "Workers in the gateways' registry mirror: routable, draining, lease expired.",
            (Query(f"max by (state) (kvgate_workers{{{M}}})", "{{state}}"),),
            width=12,
        ),
        PanelSpec(
            "Agent lease renewals",
            "Heartbeats per second each node agent sends; 0 = the worker's lease will expire.",
            (Query(f"sum by (worker) (rate(kvgate_agent_heartbeats_total{RATE}))", "{{worker}}"),),
            unit="ops", width=12,
        ),
    )),
)  # fmt: skip


def panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | stat.Panel:
    built = timeseries.Panel() if spec.kind == "timeseries" else stat.Panel()
    built.id(panel_id).title(spec.title).description(spec.description).unit(spec.unit).datasource(DATASOURCE)
    built.height(8).span(spec.width)
    for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
        built.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref).range()
        )
    return built


def build() -> dict[str, object]:
    board = (
        dashboard.Dashboard("kvgate")
        .uid(UID)
        .description("kvgate gateway and node agents: cache hit, latency, load spread, admission.")
        .tags(["kvgate", "llm", "inference"])
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model")
            .label("Model")
            .query("label_values(kvgate_requests_total, model)")
            .datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(VariableOption(text="All", value="$__all", selected=True))
        )
    )
    panel_id = 0
    for title, specs in ROWS:
        panel_id += 1
        board.with_row(dashboard.Row(title).id(panel_id))
        for spec in specs:
            panel_id += 1
            board.with_panel(panel(spec, panel_id))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(board: dict[str, object]) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) of every target in a dashboard JSON."""
    out = []
    for item in board["panels"]:  # type: ignore[attr-defined]
        for target in item.get("targets", ()):
            out.append((item["title"], target["expr"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a shipped copy is out of date")
    parser.add_argument("--stdout", action="store_true", help="print the dashboard JSON")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    stale = [p for p in SHIPPED if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python -m bench.dashboard", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
