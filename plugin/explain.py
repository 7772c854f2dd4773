"""`kvgate explain`: a request's story, or a worker's traffic, in plain words from the decision log.

    kvgate explain REQUEST_ID [--json]              why that worker, why it waited or was refused
    kvgate explain --worker W [--since 5m] [--json]  why traffic went to or away from W
    kvgate explain --export PATH [--since 1h]        the records as JSON lines (for `kvgate bench replay`)

REQUEST_ID is the `x-kvgate-request-id` response header (or the client's own `x-request-id`). The
records come from the Redis stream `kvg:decisions` (`--redis`, or KVGATE_REDIS_URL) or from a
decision-log file (`--file`, [decision_log] file). The wording functions are pure: records in, text out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = Mapping[str, Any]

# plain words for the refusal reasons (plugin/intake.py, plugin/admit.py, store/slots.py)
REFUSALS = {
    "queue_full": "the admission queue of its priority band was full",
    "wait_budget": "it waited its whole wait budget in the admission queue without getting a seat",
    "slo_unreachable": "the best worker's predicted time to first token already missed its TTFT SLO",
    "queue_too_deep": "the best worker's predicted queue was over the gateway's max_queue_ms (overload)",
    "worker_full": "every worker it could use was full",
    "quota_missing": "the model's quota was missing in Redis (a gateway rewrites it shortly)",
    "quota": "the model's quota had no room",
    "tenant": "its tenant was at its concurrent-request cap",
    "shed": "low-priority traffic is shed while higher bands have been queued for a while (overload)",
    "no_healthy_worker": "no healthy worker served the model",
    "draining": "the gateway was shutting down",
    "model_not_found": "no worker serves that model",
    "rate_limited": "its tenant was over its rate limit",
}
STEPS = {
    "intake": "at intake (parsing, authentication, validation)",
    "shed": "at the door, before queueing",
    "admission": "by admission control",
    "routing": "by routing",
}


@dataclass(frozen=True, slots=True)
class Why:
    """One routed request's placement, classified."""

    kind: str  # cache_hit | load_move | replicate | sticky | miss | baseline
    best_worker: str | None  # the worker that held the most of its prefix (None: nobody held any)
    best_blocks: int
    chosen_blocks: int


def classify(record: Record) -> Why:
    """Why a routed request went where it did, from its candidates and index hits."""
    worker = record.get("worker") or ""
    hits: Mapping[str, int] = record.get("hits") or {}
    best = max(hits, key=lambda w: (hits[w], w == worker), default=None)
    best_blocks = hits.get(best, 0) if best is not None else 0
    chosen = hits.get(worker, 0)
    reason = str(record.get("reason", ""))
    kind_of_reason = record.get("reason_kind")  # policy.types.ReasonKind; older records: the text only
    if record.get("policy") in ("round_robin", "least_loaded"):
        kind = "baseline"
    elif 0 < best_blocks <= chosen:
        kind = "cache_hit"  # (stickiness may have kept it there: the reason says so)
    elif kind_of_reason == "stickiness" or reason.startswith("sticky"):
        kind = "sticky"
    elif best_blocks == 0:
        kind = "miss"
    elif "replica" in reason:
        kind = "replicate"  # a hot prefix spread to one more worker before its holders overload
    else:
        kind = "load_move"
    return Why(kind, best if best_blocks else None, best_blocks, chosen)


def _ms(value: object) -> str:
    v = float(value or 0.0)  # type: ignore[arg-type]
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def _when(record: Record) -> str:
    at = float(record.get("arrival_ms") or 0) / 1000
    return time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d} UTC"


def _score(record: Record, worker: str, part: str) -> float | None:
    value = (record.get("candidates") or {}).get(worker, {}).get(part)
    return float(value) if isinstance(value, int | float) else None


def story(record: Record) -> str:
    """One request's story in plain words (the text `kvgate explain REQUEST_ID` prints)."""
    lines = [
        f"Request {record.get('request_id')} ({record.get('model') or 'no model'}, tenant "
        f"{record.get('tenant') or '-'}, {record.get('band')} priority) arrived at {_when(record)}"
        + (
            f" with about {record['prompt_tokens_est']} prompt tokens in "
            f"{len(record.get('prefix_hashes') or ())} prefix blocks ({record.get('index')} index)."
            if "prompt_tokens_est" in record
            else "."
        )
    ]
    if record.get("arm", "default") != "default" or record.get("policy"):
        lines.append(
            f"Routing policy: {record.get('policy') or '-'} (A/B arm {record.get('arm', 'default')})."
        )
    if record.get("worker") is None:
        lines += _refusal_lines(record)
    else:
        lines += _admission_lines(record) + _routing_lines(record) + _outcome_lines(record)
    return "\n".join(lines)


def _refusal_lines(record: Record) -> list[str]:
    reason = str(record.get("reason") or "")
    step = STEPS.get(str(record.get("refused_by") or ""), "by the gateway")
    words = REFUSALS.get(reason, reason.replace("_", " ") or "an error")
    out = [f"REFUSED {step} with HTTP {record.get('status')}: {words}."]
    queued = float(record.get("queued_ms") or 0)
    if record.get("refused_by") == "admission":
        out.append(
            f"It waited {_ms(queued)} before the refusal." if queued >= 1 else "It was refused at once."
        )
    if record.get("detail"):
        out.append(f"Gateway detail: {record['detail']}.")
    if record.get("status") == 429:
        out.append("The client was told to retry later (Retry-After header).")
    return out


def _admission_lines(record: Record) -> list[str]:
    queued = float(record.get("queued_ms") or 0)
    held = record.get("held_by")
    if held == "quota":
        return [f"Admission: it WAITED {_ms(queued)} for a seat (the model's concurrency quota was full)."]
    if held == "worker":
        return [
            f"Admission: its first-choice worker was full; {record.get('worker_full', 0)} worker(s) "
            f"turned it down, rerouted {record.get('reroutes', 0)} time(s), {_ms(queued)} in all."
        ]
    return [f"Admission: admitted at once ({_ms(queued)})."]


def _routing_lines(record: Record) -> list[str]:
    worker = str(record["worker"])
    why = classify(record)
    blocks = len(record.get("prefix_hashes") or ()) or int(record.get("prefix_blocks") or 0)
    ttft = _score(record, worker, "predicted-ttft")
    ttft_words = f" (predicted TTFT {ttft:.3f} s)" if ttft is not None else ""
    if why.kind == "cache_hit":
        head = (
            f"Routing: sent to {worker}, a CACHE HIT: it held {why.chosen_blocks} of the {blocks} prefix "
            f"blocks, the most of any worker{ttft_words}."
        )
    elif why.kind == "load_move":
        best = str(why.best_worker)
        best_ttft = _score(record, best, "predicted-ttft")
        cmp = (
            f": predicted TTFT {best_ttft:.3f} s there against {ttft:.3f} s on {worker}"
            if best_ttft is not None and ttft is not None
            else ""
        )
        head = (
            f"Routing: sent to {worker}, MOVED AWAY FROM THE CACHE BY LOAD: {best} held more of the "
            f"prefix ({why.best_blocks} of {blocks} blocks, against {why.chosen_blocks} on {worker}) "
            f"but was busier{cmp}."
        )
    elif why.kind == "replicate":
        head = (
            f"Routing: sent to {worker}, MOVED AWAY FROM THE CACHE TO SPREAD A HOT PREFIX: "
            f"{why.best_worker} held {why.best_blocks} of its {blocks} blocks, but this prefix arrives so "
            f"often that kvgate adds a replica on {worker} (one prefill there) before the holders are "
            f"overloaded; it scores every worker as if it held the prefix{ttft_words}."
        )
    elif why.kind == "sticky":
        head = (
            f"Routing: sent to {worker}, STICKY: it served this prefix recently and is not "
            f"overloaded{ttft_words}."
        )
    elif why.kind == "miss":
        head = (
            f"Routing: sent to {worker}, a MISS: no worker held any of its prefix, so the least "
            f"loaded one{ttft_words}."
        )
    else:
        head = f"Routing: sent to {worker} by the {record.get('policy')} baseline (it ignores the cache)."
    out = [head, f"Policy's own words: {record.get('reason')}."]
    out += _candidate_table(record)
    return out


def _candidate_table(record: Record) -> list[str]:
    candidates: Mapping[str, Mapping[str, float]] = record.get("candidates") or {}
    if not candidates:
        return []
    parts = list(next(iter(candidates.values())))
    hits: Mapping[str, int] = record.get("hits") or {}
    header = f"  {'worker':<12}{'cached blocks':>14}" + "".join(f"{p:>16}" for p in parts)
    rows = [header]
    order = sorted(candidates, key=lambda w: candidates[w].get("cost", 0.0))
    for w in order:
        mark = "*" if w == record.get("worker") else " "
        rows.append(
            f"{mark} {w:<12}{hits.get(w, 0):>14}"
            + "".join(f"{candidates[w].get(p, 0.0):>16.3f}" for p in parts)
        )
    return ["Candidates (* = chosen; lowest cost wins):", *rows]


def _outcome_lines(record: Record) -> list[str]:
    status = record.get("status")
    text = f"Outcome: HTTP {status} after {_ms(record.get('latency_ms'))}"
    if "ttft_ms" in record:
        text += f", first token after {_ms(record['ttft_ms'])}"
    prompt, cached = record.get("prompt_tokens"), record.get("cached_tokens")
    if prompt and cached is not None:
        text += (
            f"; the worker reused {cached} of {prompt} prompt tokens from its cache ({cached / prompt:.0%})"
        )
    if record.get("error"):
        text += f"; error: {record['error']}"
    return [text + "."]


def worker_summary(records: Sequence[Record], worker: str, since_s: float) -> dict[str, Any]:
    """Why traffic went to or away from `worker` in `records` (the --worker report, as data)."""
    to: Counter[str] = Counter()
    away: Counter[str] = Counter()
    away_to: Counter[str] = Counter()
    routed = 0
    refused = 0
    ttft_here: list[float] = []
    hits = prompt = 0
    for r in records:
        if r.get("worker") is None:
            refused += 1
            continue
        routed += 1
        why = classify(r)
        if r["worker"] == worker:
            to[why.kind] += 1
            if "ttft_ms" in r:
                ttft_here.append(float(r["ttft_ms"]))
            if r.get("prompt_tokens") and r.get("cached_tokens") is not None:
                hits += int(r["cached_tokens"])
                prompt += int(r["prompt_tokens"])
        elif why.best_worker == worker and why.kind in ("load_move", "replicate"):
            away[why.kind] += 1  # it held the most of the prefix, another worker took the request
            away_to[str(r["worker"])] += 1
    return {
        "worker": worker,
        "since_s": since_s,
        "requests": routed + refused,
        "routed": routed,
        "refused": refused,
        "to_worker": sum(to.values()),
        "share": sum(to.values()) / routed if routed else 0.0,
        "to_worker_by_kind": dict(to),
        "away_by_load": away["load_move"] + away["replicate"],
        "away_by_kind": dict(away),
        "away_to": dict(away_to),
        "hit_rate": hits / prompt if prompt else None,
        "ttft_p50_ms": _median(ttft_here),
    }


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


KIND_WORDS = {
    "cache_hit": "cache hits (it held the longest cached prefix)",
    "load_move": "moved here by load (another worker held more of the prefix but was busier)",
    "replicate": "a hot prefix spread here (a new replica, so its holders do not overload)",
    "sticky": "sticky (it served the prefix recently)",
    "miss": "misses (nobody held the prefix; it was the least loaded)",
    "baseline": "sent by a baseline policy (round robin / least loaded)",
}


def worker_text(summary: Mapping[str, Any]) -> str:
    w = summary["worker"]
    lines = [
        f"Worker {w}, last {_span(summary['since_s'])}: {summary['to_worker']} of {summary['routed']} routed "
        f"requests ({summary['share']:.0%} of the traffic); {summary['refused']} other request(s) were "
        "refused before routing."
    ]
    if summary["to_worker"]:
        lines.append("Why requests went TO it:")
        for kind, n in sorted(summary["to_worker_by_kind"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n:>6}  {KIND_WORDS.get(kind, kind)}")
    if summary["away_by_load"]:
        dest = ", ".join(f"{k} {v}" for k, v in sorted(summary["away_to"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"Why requests went AWAY from it: {summary['away_by_load']} request(s) whose prefix it held "
            f"best went elsewhere because of load ({_kinds(summary['away_by_kind'])}; to: {dest})."
        )
    else:
        lines.append("No request whose prefix it held best went elsewhere.")
    if summary["hit_rate"] is not None:
        lines.append(f"Its measured prefix-cache hit rate on these requests: {summary['hit_rate']:.0%}.")
    if summary["ttft_p50_ms"] is not None:
        lines.append(f"Median time to first token there: {_ms(summary['ttft_p50_ms'])}.")
    return "\n".join(lines)


def _kinds(counts: Mapping[str, int]) -> str:
    words = {"load_move": "it was busier", "replicate": "a hot prefix got another replica"}
    return ", ".join(f"{n} {words.get(k, k)}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def parse_since(text: str) -> float:
    """ "90s", "5m", "2h" or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ValueError(f"--since takes a duration like 90s, 5m or 2h, not {text!r}") from None


def matches(record: Record, request_id: str) -> bool:
    return request_id in (record.get("request_id"), record.get("client_request_id"))


# -- the shell: reading the records ------------------------------------------------------------------
def read_file(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a decision-log file (and its rotated PATH.1 first), oldest first."""
    for p in (path.with_name(path.name + ".1"), path):
        if not p.exists():
            continue
        with p.open(encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    yield json.loads(line)


async def read_stream(url: str, since_ms: float | None) -> list[dict[str, Any]]:
    """Records of the Redis stream, oldest first (only those after `since_ms` wall time if given)."""
    from store.connect import redis_from_url

    redis = redis_from_url(url)
    try:
        start = f"{int(since_ms)}-0" if since_ms is not None else "-"
        out = []
        for _, fields in await redis.xrange("kvg:decisions", min=start) or []:
            raw = (fields or {}).get(b"record") or (fields or {}).get("record")
            if raw is not None:
                out.append(json.loads(raw))
        return out
    finally:
        await redis.aclose()


def load_records(args: argparse.Namespace, since_s: float | None) -> list[dict[str, Any]]:
    since_ms = (time.time() - since_s) * 1000 if since_s is not None else None
    if args.file:
        records: Iterable[dict[str, Any]] = read_file(Path(args.file))
        if since_ms is not None:
            records = (r for r in records if float(r.get("arrival_ms") or 0) >= since_ms)
        return list(records)
    if not args.redis:
        raise ValueError("give --redis URL (or KVGATE_REDIS_URL) or --file PATH")
    return asyncio.run(read_stream(args.redis, since_ms))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate explain", description=__doc__.split("\n")[0])
    p.add_argument("request_id", nargs="?", help="x-kvgate-request-id (or the client's x-request-id)")
    p.add_argument("--worker", help="summarise why traffic went to or away from this worker")
    p.add_argument("--since", default="5m", help="with --worker/--export: how far back (90s, 5m, 2h)")
    p.add_argument("--export", type=Path, help="write the records as JSON lines here")
    p.add_argument("--json", action="store_true", help="print JSON instead of words")
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_REDIS_URL"), help="Redis URL (or KVGATE_REDIS_URL)"
    )
    p.add_argument("--file", help="read a decision-log file ([decision_log] file) instead of Redis")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if sum(x is not None for x in (args.request_id, args.worker, args.export)) != 1:
        print("kvgate explain: give one of REQUEST_ID, --worker W or --export PATH", file=sys.stderr)
        return 2
    try:
        since_s = parse_since(args.since) if args.request_id is None else None
        records = load_records(args, since_s)
    except (ValueError, OSError) as e:
        print(f"kvgate explain: {e}", file=sys.stderr)
        return 2
    if args.export is not None:
        with args.export.open("w", encoding="utf-8") as out:
            for r in records:
                out.write(json.dumps(r, separators=(",", ":")) + "\n")
        print(f"{len(records)} records written to {args.export}", file=sys.stderr)
        return 0
    if args.worker is not None:
        summary = worker_summary(records, args.worker, since_s or 0.0)
        print(json.dumps(summary, indent=2) if args.json else worker_text(summary))
        return 0 if summary["requests"] else 1
    found = [r for r in records if matches(r, args.request_id)]
    if not found:
        print(f"kvgate explain: no decision record for {args.request_id!r} (the log keeps the newest records "
              "only; check --redis / --file)", file=sys.stderr)  # fmt: skip
        return 1
    for record in found[-1:]:
        if args.json:
            print(json.dumps({"story": story(record), "why": _why_json(record), "record": record}, indent=2))
        else:
            print(story(record))
    return 0


def _why_json(record: Record) -> dict[str, Any] | None:
    if record.get("worker") is None:
        return None
    why = classify(record)
    return {"kind": why.kind, "best_worker": why.best_worker, "best_blocks": why.best_blocks,
            "chosen_blocks": why.chosen_blocks}  # fmt: skip
