"""What a proactive replica of a hot prefix will bring against what it costs (`replicas.proactive_when =
"priced"`, policy/kvgate.py). Pure arithmetic, in seconds of requests' time.

    benefit = T × p/s × [H·L(x/H) − (H+1)·L(x/(H+1))]   the prefix's own queueing, spread over one
                                                         more holder, in the requests' time to first token
            + λ × lead² / 2                              the requests that arrive while the holders' present
                                                         backlog drains, each sooner on the copy
    cost    = invest + evict                             this request's extra prefill on the copy, plus the
                                                         KV the copy pushes out of the target, recomputed once
    a copy is priced as an investment only while benefit > cost; otherwise it is a plain recompute

where every quantity is one the policy already has:
  λ       the prefix's request rate, bias-corrected for its age (`unbiased_rate`): the EWMA from 0 reads a
          new prompt's k requests in its first seconds as k·ln 2 ÷ half-life, 1/10 of a 10 req/s prompt
          after 2 s (docs/BENCHMARKS.md "hot before its rate is known", session 8); the correction is
          the cluster `LoadMeter`'s (policy/state.py), so a steady stream reads its rate at any age
  x       the prefix's engine load, λ × `TtftModel.work_s` of this request on a holder (its uncached
          tail, its decode of max_tokens): engine seconds per second, the unit of `cluster_load`
  L(ρ)    requests in the system at utilisation ρ, ρ ÷ (1 − ρ), infinite at ρ ≥ 1 (the holders cannot
          carry the prefix: the copy is needed whatever it costs); a batching engine serves its requests
          side by side, as processor sharing (M/G/1-PS has the M/M/1 L for any service time), so each
          request is slowed by 1 ÷ (1 − ρ) over its whole service s = `work_s`, and its TTFT over its
          prefill p = `own_prefill_s` of its tail: the TTFT part of the saving is p/s of it
  H       the prefix's holders among the candidates; the copy is the (H+1)-th
  T       the copy's useful life, `sticky.window_s` (the article's hold time: how long a placement is
          kept, the horizon `_replica_share` already prices a replica over). The prefix's age as the
          horizon (a prefix seen for a seconds lasts a more, Gott's rule) was measured and not kept: it
          priced burst's steady prompts on their first seconds and cost burst's p99 (docs/BENCHMARKS.md,
          session 12)
  lead    the best holder's predicted TTFT minus the copy's once it holds the prefix (≥ 0)
  invest  the copy's TTFT for this request minus that TTFT with the prefix held: its prefill of the prefix
  evict   the prefill of the copy's new tokens that do not fit in the target's free KV (the router's
          index fill of the target × its `capacity_tokens`): blocks of other prefixes that an LRU pushes
          out, each assumed asked for once more (an upper bound for one-off prompts)
"""

from __future__ import annotations

import math


def unbiased_rate(ewma: float, age_s: float, half_life_s: float) -> float:
    """The EWMA rate of a prefix (seeded with its first request's step ln 2 ÷ h), corrected for its age
    the way `LoadMeter` corrects: the requests after the first, ÷ the decay integral over the age,
    (ewma − step·f) ÷ (1 − f) with f = 2^(−age/h). A steady stream of λ reads λ at any age; an old
    prefix (age ≫ h) reads its EWMA. Age 0 (unknown or the first request): the EWMA."""
    if age_s <= 0.0 or half_life_s <= 0.0:
        return ewma
    first: float = 0.5 ** (age_s / half_life_s)
    step = math.log(2) / half_life_s
    return max(ewma, (ewma - step * first) / (1.0 - first))


def in_system(rho: float) -> float:
    """L(ρ) = ρ ÷ (1 − ρ), requests in an M/M/1 system at utilisation ρ (infinite at ρ ≥ 1)."""
    return math.inf if rho >= 1.0 else max(0.0, rho) / (1.0 - rho)


def copy_benefit_s(
    rate: float, work_s: float, prefill_s: float, holders: int, horizon_s: float, lead_s: float
) -> float:
    """TTFT-seconds a (holders+1)-th copy saves the prefix's requests (module docstring)."""
    x = rate * work_s
    h = max(1, holders)
    before, after = h * in_system(x / h), (h + 1) * in_system(x / (h + 1))
    share = (
        min(1.0, prefill_s / work_s) if work_s > 0 else 0.0
    )  # the part of a request before its first token
    spread = math.inf if math.isinf(before) else horizon_s * share * max(0.0, before - after)
    lead = max(0.0, lead_s)
    return spread + rate * lead * lead / 2.0


def evicted_tokens(new_tokens: int, fill: float, capacity_tokens: int) -> int:
    """Tokens of other prefixes that `new_tokens` push out of a KV cache `fill` (0–1) full of
    `capacity_tokens` (0 = unknown: none)."""
    if capacity_tokens <= 0 or new_tokens <= 0:
        return 0
    free = round(max(0.0, 1.0 - fill) * capacity_tokens)
    return min(new_tokens, max(0, new_tokens - free))
