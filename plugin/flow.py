"""The per-flow types every request-path part shares: one typed `FlowState` per request, its `Prompt`
and its `Route`, and the guards each hook starts with.

Every part reads and writes the `FlowState` in `flow.metadata[STATE]` (STYLE §7.3) instead of loose
metadata keys. The process-wide services the parts use are `plugin.context.GatewayContext`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from mitmproxy import http
from redis.exceptions import RedisError

from plugin.errors import openai_error
from policy.types import Band
from store.slots import LeaseLost

if TYPE_CHECKING:
    from plugin.auth import Caller
    from plugin.parse import ParsedRequest
    from plugin.streaming import SseMeter
    from policy.session import SessionBinding
    from policy.types import Decision, RequestView
    from store.registry import WorkerRecord
    from store.slots import Lease

logger = logging.getLogger(__name__)

STATE = "kvgate"
# a band's label in metrics and records; a dict read, as `Band.name` is a Python-level property (enum)
BAND_NAMES = {band: band.name.lower() for band in Band}


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prefix, hashed once before admission (so a 400 for a bad shape comes first)."""

    hashes: tuple[int, ...]
    block_tokens: tuple[int, ...]
    prompt_tokens: int
    exact: bool = False  # token-block hashes (exact mode), else text-chunk hashes


@dataclass(frozen=True, slots=True)
class Upstream:
    scheme: str
    host: str
    port: int


MEMO_LIMIT = 4096  # worker addresses remembered; far above any pool one gateway routes to at once
_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(memo: dict[_K, _V], key: _K, value: _V) -> _V:
    """Store `value` in a per-worker-address memo (the caller looked it up and missed). Emptied when
    full, so the addresses of workers long gone (an autoscaled fleet's churn) do not pile up."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value
    return value


@dataclass(slots=True)
class Route:
    """Where one request goes, and why."""

    model: str
    worker: WorkerRecord
    upstream: Upstream
    decision: Decision
    view: RequestView
    first_token_seen: bool = False
    streamed: bool = True  # a first-token signal comes back before the end (the ledger's lateness)
    # which index entries the chosen worker's prefix match rested on, at decision time:
    # exact (KV events) | speculative (routed, not yet confirmed) | approximate (routing history) | none
    index_kind: str = "none"
    # hit feedback: when the index last saw each block it expected the worker to hold used there, read
    # before this route's commit (RoutingState.hit_expectation); () = nothing the usage could contradict
    expected_touched_s: Sequence[float] = ()


@dataclass(frozen=True, slots=True)
class Held:
    """Which admission step held a request that was not placed at once on its first choice."""

    held_by: str  # "quota" waited for a seat; "worker" a chosen worker was full
    reroutes: int  # workers tried after a full one
    worker_full: int  # workers that turned the request down

    def record(self) -> dict[str, object]:
        """The fields of the decision record (`NOT_HELD` when admitted at once)."""
        return {"held_by": self.held_by, "reroutes": self.reroutes, "worker_full": self.worker_full}


NOT_HELD: dict[str, object] = {"held_by": None, "reroutes": 0, "worker_full": 0}


@dataclass(slots=True)
class SessionRef:
    """A request's session: its id, whether it closes the session, and what routing made of it."""

    id: str
    close: bool = False
    binding: SessionBinding | None = None  # looked up before routing
    outcome: str = ""  # policy.session.outcome once placed
    bound_to: str = ""  # the worker this request bound the session to (counted in flight)


@dataclass(slots=True)
class FlowState:
    """One completion request on its way through the gateway."""

    request_id: str  # the gateway's own lease id (plugin/intake.py lease_id), never the client's header
    received_at: float  # time.monotonic() when the request hook saw it
    client_request_id: str = ""  # the client's validated x-request-id (a correlation field only)
    parsed: ParsedRequest | None = None
    caller: Caller | None = None
    prompt: Prompt | None = None  # set by intake with the caller and the body
    session: SessionRef | None = None  # x-kvgate-session-id (plugin/sessions.py), validated by intake
    lease: Lease | None = None  # while a slot is held; popped exactly once on release
    queued_s: float = 0.0
    held: Held | None = None  # set when admission held the request (quota or a full worker)
    refused: tuple[str, str, str] | None = None  # (step, reason, detail) when the gateway answered it
    route: Route | None = None
    usage_requested: bool = False  # the gateway asked the worker for the stream's usage chunk
    meter: SseMeter | None = None
    status: int = 0
    error: str = ""
    finished: bool = False
    arm: str = "default"
    # hot-path CPU per stage so far, ns (plugin/metrics.py HotPathCpu: added under the arm on release)
    stage_ns: dict[str, int] = field(default_factory=dict)
    dispatched_at: float = 0.0  # now_s() at the end of the dispatch hook: the request goes upstream next

    @property
    def model(self) -> str:
        return self.parsed.model if self.parsed else ""

    @property
    def band_name(self) -> str:
        return BAND_NAMES[self.caller.band] if self.caller else "normal"


def state_of(flow: http.HTTPFlow) -> FlowState | None:
    state = flow.metadata.get(STATE)
    return state if isinstance(state, FlowState) else None


def answered(flow: http.HTTPFlow) -> bool:
    """True once the flow needs nothing more from request-phase parts (STYLE §1 guard)."""
    return flow.response is not None or flow.error is not None or not flow.live


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request intake parsed, authenticated and hashed: what the later request-phase parts read."""

    state: FlowState
    parsed: ParsedRequest
    caller: Caller
    prompt: Prompt


def accepted(flow: http.HTTPFlow) -> Accepted | None:
    """A live flow that intake parsed, authenticated and hashed; None when a later request-phase
    part has nothing to do (answered already, or not a completion request)."""
    if answered(flow):
        return None
    state = state_of(flow)
    if state is None or state.parsed is None or state.caller is None or state.prompt is None:
        return None
    return Accepted(state, state.parsed, state.caller, state.prompt)


A = TypeVar("A")


def fail_closed(
    hook: Callable[[A, http.HTTPFlow], Awaitable[None]],
) -> Callable[[A, http.HTTPFlow], Awaitable[None]]:
    """mitmproxy swallows hook errors and lets the flow go on to the fallback upstream; answer instead:
    Redis unreachable or too slow (gateway.redis_failure = "closed") and a lease lost meanwhile are
    503 with Retry-After, which a client may retry; anything else is a bug: 500."""

    @functools.wraps(hook)
    async def wrapper(self: A, flow: http.HTTPFlow) -> None:
        try:
            await hook(self, flow)
        except (RedisError, OSError) as e:  # (TimeoutError is an OSError)
            _log_redis_failure(hook.__qualname__, e)
            if flow.live and flow.response is None and flow.error is None:
                flow.response = openai_error(
                    503, "redis_unavailable", "the admission store is unreachable; retry shortly",
                    retry_after_s=1,
                )  # fmt: skip
        except LeaseLost as e:
            logger.warning("%s: %s", hook.__qualname__, e)
            if flow.live and flow.response is None and flow.error is None:
                flow.response = openai_error(
                    503, "lease_lost", "the request's admission lease expired before it was placed; retry",
                    retry_after_s=1,
                )  # fmt: skip
        except Exception:
            logger.exception("%s failed", hook.__qualname__)
            if flow.live and flow.response is None and flow.error is None:
                flow.response = openai_error(500, "gateway_error", "internal gateway error")

    return wrapper


_redis_failures_logged = {"at": 0.0}


def _log_redis_failure(where: str, error: BaseException) -> None:
    """One warning per second at most: an outage is not thousands of tracebacks."""
    now = time.monotonic()
    if now - _redis_failures_logged["at"] >= 1.0:
        _redis_failures_logged["at"] = now
        logger.warning("%s: Redis unreachable (answering 503): %s: %s", where, type(error).__name__, error)


def put_headers(headers: http.Headers, pairs: Sequence[tuple[str, str]]) -> None:
    """`headers[name] = value` for each (lower-case name, value), in one rebuild of the field list
    instead of one per header (a header already present is replaced; ours go last)."""
    new = tuple([(name.encode(), value.encode("utf-8", "surrogateescape")) for name, value in pairs])
    names = {name for name, _ in new}
    headers.fields = tuple([f for f in headers.fields if f[0].lower() not in names]) + new


# time.monotonic itself, not a function calling it: one Python call less each time (4 per request)
now_s: Callable[[], float] = time.monotonic


def header(message: http.Message, name: bytes) -> str | None:
    """`message.headers.get(name)` for a lower-case `name`: the values of its fields, folded with ", "
    (None when absent), from one pass over the field list without mitmproxy's per-field calls."""
    values = [
        v.decode("utf-8", "surrogateescape") for n, v in message.data.headers.fields if n.lower() == name
    ]
    return ", ".join(values) if values else None


def body_of(message: http.Message) -> bytes | None:
    """`message.content`: the body decoded by its Content-Encoding; without one (the common case), the
    raw body as `Message.get_content` returns it, read without its header lookup."""
    data = message.data
    for name, _ in data.headers.fields:
        if name.lower() == b"content-encoding":
            return message.content
    return data.content
