"""The naive routing rules every policy must beat, shared by the gateway (`round_robin`, `least_loaded`
policies, plugin/routing.py) and the simulator's baselines (bench/sim/baselines.py).

Both ignore the prefix cache. Pure: the caller keeps the round-robin turn and supplies the load of a
worker and, where it wants one, a tie-break key (the gateway draws it from its seeded RNG; the
simulator keeps registry order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def round_robin(workers: Sequence[str], turn: int) -> str:
    """The worker whose turn it is: `workers` in order, one after another (`turn` counts from 0)."""
    if not workers:
        raise ValueError("no workers to pick from")
    return workers[turn % len(workers)]


def least_loaded(
    workers: Sequence[str], load: Callable[[str], float], tie_break: Callable[[str], float] | None = None
) -> str:
    """The worker with the lowest `load`; among equal loads the lowest `tie_break` key, or without one
    the first in `workers` order. `tie_break` is called once per worker, in order."""
    if not workers:
        raise ValueError("no workers to pick from")
    if tie_break is None:
        return min(workers, key=load)  # min keeps the first of equal keys
    return min(workers, key=lambda w: (load(w), tie_break(w)))
