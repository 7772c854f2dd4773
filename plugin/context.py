"""`GatewayContext`: the process-wide services a request-path part may use, passed explicitly.

The addon (plugin/addon.py) builds the services at start and hands one frozen bundle to each part
(intake, admission, placement, dispatch, release). A part imports this bundle and the flow types
(plugin/flow.py), never the addon, so it can be built and tested with just the services it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugin.auth import Auth
from plugin.config import GatewayConfig
from plugin.decision_log import DecisionLog
from plugin.local import LocalEndpoints
from plugin.metrics import GatewayMetrics
from plugin.open_admission import OpenShare
from plugin.prefix_memo import PromptHasher
from plugin.process_state import ProcessState
from plugin.releaser import Releaser
from plugin.routing import Router
from plugin.sessions import SessionAffinity
from plugin.workers import WorkerPool
from policy.pressure import PressureTracker
from store.slots import SlotPool


@dataclass(frozen=True, slots=True)
class GatewayContext:
    gateway_id: str
    config: GatewayConfig
    auth: Auth  # the caller of a request: tenant, band, wait budget
    metrics: GatewayMetrics
    workers: WorkerPool  # routable workers per model (the mirror minus refusing workers)
    router: Router  # the routing choice and this gateway's load accounting
    hasher: PromptHasher  # prefix hashes (shared prefixes hashed once)
    pool: SlotPool  # global admission: seats, queues, placement on a worker
    releaser: Releaser  # leases given back by the flows, sent in batches
    pressure: PressureTracker  # sheds low priority under sustained pressure
    decisions: DecisionLog  # one record per finished request
    process: ProcessState  # draining; who waits for admission
    local: LocalEndpoints  # /v1/models, /readyz
    sessions: SessionAffinity  # explicit session affinity: bindings in Redis (plugin/sessions.py)
    open_share: OpenShare | None = None  # redis_failure = "open": the local share (plugin/open_admission.py)
