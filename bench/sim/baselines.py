"""Naive routers every policy must beat: round-robin, seeded random, least in-flight (R signal).

They ignore the prefix cache entirely; least in-flight breaks ties by registry order (first_argmin,
PEERS.md conventions).
"""

from __future__ import annotations

import random

from bench.sim.types import ClusterView, NoFeedback, SimRequest
from policy.baselines import least_loaded, round_robin


class RoundRobin(NoFeedback):
    """Workers in registry order, one after another."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        worker = round_robin(cluster.worker_ids, self._next)
        self._next += 1
        return worker


class RandomRouter(NoFeedback):
    """A uniformly random worker from a seeded generator."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return self._rng.choice(list(cluster.worker_ids))


class LeastInflight(NoFeedback):
    """The worker with the fewest requests dispatched and not finished; ties go to registry order."""

    name = "least_inflight"

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return least_loaded(cluster.worker_ids, cluster.inflight)  # ties: registry order


def make_round_robin(seed: int) -> RoundRobin:
    return RoundRobin()


def make_random(seed: int) -> RandomRouter:
    return RandomRouter(seed)


def make_least_inflight(seed: int) -> LeastInflight:
    return LeastInflight()
