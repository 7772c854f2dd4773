"""Stable policy names -> router factories `factory(seed) -> Router`, imported only when selected.

The names are the interface of `kvgate bench sim --policies` and of results.json (issue 2). Factories
are "module:attr" strings so a peer module that is missing or broken fails only when it is asked for;
`all` means every policy whose module imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from bench.sim.types import Router

RouterFactory = Callable[[int], Router]

POLICIES: dict[str, str] = {
    "round_robin": "bench.sim.baselines:make_round_robin",
    "random": "bench.sim.baselines:make_random",
    "least_inflight": "bench.sim.baselines:make_least_inflight",
    "chwbl": "bench.peers.chwbl:make_router",
    "sglang": "bench.peers.sglang:make_router",
    "sglang_legacy": "bench.peers.sglang:make_legacy_router",
    "vllm_router": "bench.peers.vllm_router:make_router",
    "smg": "bench.peers.smg:make_router",
    "llmd_approx": "bench.peers.llmd:make_approx_router",
    "llmd_precise": "bench.peers.llmd:make_precise_router",
    "dynamo": "bench.peers.dynamo:make_router",
    "preble": "bench.peers.preble:make_router",
    "article": "bench.sim.policy_router:make_article_router",
    "kvgate": "bench.sim.policy_router:make_kvgate_router",
    "kvgate_session": "bench.sim.policy_router:make_kvgate_session_router",
}


class UnknownPolicy(ValueError):
    """A policy name that is not registered or whose module cannot be imported."""


def load_factory(name: str) -> RouterFactory:
    """The factory of a registered policy; raises UnknownPolicy with the reason."""
    target = POLICIES.get(name)
    if target is None:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownPolicy(f"policy {name!r} is not available: cannot import {module_name} ({e})") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise UnknownPolicy(f"policy {name!r} is not available: {module_name} has no {attr}")
    return factory  # type: ignore[no-any-return]


INDEXED = (
    "kvgate",
    "kvgate_session",
    "article",
)  # policies that take an index model: "kvgate@exact" (policy_router.py)


def split_index(name: str) -> tuple[str, str | None]:
    """("kvgate", "exact") for "kvgate@exact"; (name, None) without an index model."""
    base, _, index = name.partition("@")
    return base, index or None


def run_name(run: Mapping[str, object]) -> str:
    """The policy name a run object was asked for: `kvgate@exact` for a run with an index model."""
    index = run.get("index")
    return f"{run['policy']}@{index}" if index else str(run["policy"])


def make_router(name: str, seed: int) -> Router:
    base, index = split_index(name)
    if index is None:
        return load_factory(base)(seed)
    return load_factory(base)(seed, index=index)  # type: ignore[call-arg]


def with_indexes(policies: list[str], spec: str) -> list[str]:
    """`--index exact,approx,oracle`: each policy that takes one once per index model."""
    from bench.sim.policy_router import INDEX_MODELS

    indexes = [i.strip() for i in spec.split(",") if i.strip()]
    bad = [i for i in indexes if i not in INDEX_MODELS]
    if not indexes or bad:
        raise UnknownPolicy(f"--index takes {', '.join(INDEX_MODELS)}, not {spec!r}")
    others = [p for p in policies if p not in INDEXED]
    if others:
        raise UnknownPolicy(f"--index applies to {', '.join(INDEXED)} only, not {', '.join(others)}")
    return [f"{p}@{i}" for p in policies for i in indexes]


def available_policies() -> list[str]:
    """Registered names whose factory imports, in registry order."""
    names = []
    for name in POLICIES:
        try:
            load_factory(name)
        except UnknownPolicy:
            continue
        names.append(name)
    return names


def resolve_policies(spec: str) -> list[str]:
    """`all` or a comma-separated list -> names, checked; raises UnknownPolicy for a bad name."""
    if spec.strip() == "all":
        return available_policies()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UnknownPolicy("no policy given")
    for name in names:
        base, index = split_index(name)
        if index is not None:  # "kvgate@exact": the same checks as --index
            with_indexes([base], index)
        load_factory(base)
    return list(dict.fromkeys(names))
