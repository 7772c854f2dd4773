"""The design article's routing formula (seed §2.3–2.4) as a selectable policy (`policy = "article"`).

    cost(w) = W_LOAD·load(w) + W_CACHE·(1 − hit(w)/len) + W_STABLE·stable(w),   lowest wins
    defaults W_LOAD 1.2, W_CACHE 0.7, W_STABLE 0.3; load = inflight / load_saturate_inflight, capped at 1

Sign quirk: the article's pseudo-code adds STABLE_PENALTY (a positive number) to the worker the prefix
was *last routed to*, which with "lowest wins" pushes requests away from it — the opposite of its stated
purpose (suppress oscillation). We read the intent: stable(w) = 0 for the sticky worker, 1 for any other,
i.e. the penalty is paid for switching. With scores s ∈ [0, 1] (higher better) this is exactly a
max-score profile: cost = Σ W − Σ W·s, using scorers load, prefix-match and stickiness.

§2.4 additions: a match below `min_cache_gain` (30 %) of the prompt counts as no match, and within the
stickiness window a prefix stays on its worker unless that worker reaches `load_saturate_inflight`
in-flight requests (the article's "hard threshold") or is gone.
"""

from __future__ import annotations

from policy.config import RoutingConfig
from policy.filters import Eligible, StickyHold
from policy.pickers import MaxScore
from policy.profile import Profile
from policy.scorers import Load, PrefixMatch, Stickiness


def article_policy(config: RoutingConfig) -> Profile:
    """The article's formula as a filters → scorers → picker profile."""
    a = config.article
    return Profile(
        name="article",
        filters=(
            Eligible(),
            StickyHold(config=config.sticky, overload_inflight=a.load_saturate_inflight),
        ),
        scorers=(
            (Load(saturate_at=a.load_saturate_inflight), a.w_load),
            (PrefixMatch(min_gain=config.min_cache_gain), a.w_cache),
            (Stickiness(window_s=config.sticky.window_s), a.w_stable),
        ),
        picker=MaxScore(),
    )
