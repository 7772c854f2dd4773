"""Calibration profiles of the simulated GPU worker: what one vLLM-like engine costs per step.

A profile is a TOML file in bench/sim/profiles/ (package data) with the KV pool, the scheduler limits
and the coefficients of the step-time model of shared/reference/ENGINE.md §8:

    t_step = t0 + max(t_w + e·B, b·N) + c·Σ n_i·(ctx_i + n_i/2) + f·Σ ctx_j        (milliseconds)
             [+ t_prefill if the step schedules prompt tokens; optional, 0 when absent]

B = decoding sequences in the step, N = B + Σ n_i scheduled tokens, n_i = new prefill tokens of request i
after ctx_i tokens already in its KV cache, ctx_j = context of decoding sequence j. Every number in a profile
file carries a `<key>_source` string citing where it comes from; the loader refuses a number without one.

`prefill_time_s` and `decode_step_s` price work the way the engine would run it alone; the simulator uses
them to turn an offered load into a fraction of cluster capacity.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"

_INT_KEYS = ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs")
_FLOAT_KEYS = (
    "t0_ms",
    "t_w_ms",
    "b_ms_per_token",
    "c_ms_per_token_ctx",
    "e_ms_per_seq",
    "f_ms_per_ctx_token",
)
_TEXT_KEYS = ("name", "gpu", "model")
_OPTIONAL_TEXT_KEYS = ("engine",)
_OPTIONAL_INT_KEYS = ("max_model_len",)  # absent: the KV pool is the only limit
# absent: 0. Only the profile of NVIDIA Dynamo's mocker sets it (its prefill time has a per-step constant)
_OPTIONAL_FLOAT_KEYS = ("t_prefill_ms",)


class ProfileError(ValueError):
    """A profile file is missing, malformed, or has a bad value; the message names the file and key."""


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's KV pool, scheduler limits and step-time coefficients (ms units as in the names)."""

    name: str
    gpu: str
    model: str
    block_size: int  # tokens per engine KV block
    num_gpu_blocks: int  # engine KV blocks in the pool
    max_num_batched_tokens: int  # token budget per step
    max_num_seqs: int  # running requests at most
    t0_ms: float  # fixed per-step overhead
    t_w_ms: float  # weight read per step (memory-bound floor)
    b_ms_per_token: float  # linear-layer compute per scheduled token
    c_ms_per_token_ctx: float  # prefill attention per (new token x context token)
    e_ms_per_seq: float  # per decoding sequence growth below the ridge
    f_ms_per_ctx_token: float  # decode KV read per context token
    max_model_len: int | None = None  # longest request (prompt + output) the engine accepts
    t_prefill_ms: float = 0.0  # extra per-step overhead of a step that schedules prompt tokens
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def capacity_tokens(self) -> int:
        """KV pool size in tokens (vLLM logs it as 'GPU KV cache size: N tokens')."""
        return self.num_gpu_blocks * self.block_size

    @property
    def max_context_tokens(self) -> int:
        """The longest context one request may have: max_model_len, never more than the KV pool."""
        return min(self.max_model_len or self.capacity_tokens, self.capacity_tokens)


def list_profiles() -> list[str]:
    """Names of the profiles shipped with kvgate."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """Load a shipped profile by name, or any profile TOML by path; raise ProfileError on any defect."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise ProfileError(f"unknown profile {name_or_path!r}; shipped: {', '.join(list_profiles())}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from e
    return _parse(raw, str(path))


def _parse(raw: dict[str, Any], where: str) -> EngineProfile:
    numbers = (*_INT_KEYS, *_FLOAT_KEYS)
    optional = tuple(k for k in _OPTIONAL_INT_KEYS if raw.get(k) is not None)
    optional_floats = tuple(k for k in _OPTIONAL_FLOAT_KEYS if raw.get(k) not in (None, 0, 0.0))
    allowed = {
        *_TEXT_KEYS,
        *_OPTIONAL_TEXT_KEYS,
        *numbers,
        *(f"{k}_source" for k in numbers),
        *_OPTIONAL_INT_KEYS,
        *(f"{k}_source" for k in _OPTIONAL_INT_KEYS),
        *_OPTIONAL_FLOAT_KEYS,
        *(f"{k}_source" for k in _OPTIONAL_FLOAT_KEYS),
    }
    for key in raw:
        if key not in allowed:
            raise ProfileError(f"{where}: unknown key {key!r}")
    for key in (*_TEXT_KEYS, *numbers, *(f"{k}_source" for k in numbers)):
        if key not in raw:
            raise ProfileError(f"{where}: missing key {key!r}")
    for key in (*_TEXT_KEYS, *_OPTIONAL_TEXT_KEYS, *(f"{k}_source" for k in numbers)):
        if key in raw and not (isinstance(raw[key], str) and raw[key].strip()):
            raise ProfileError(f"{where}: {key} must be a non-empty string")
    for key in (*optional, *optional_floats):
        if f"{key}_source" not in raw:
            raise ProfileError(f"{where}: missing key {key + '_source'!r}")
    for key in (*_INT_KEYS, *optional):
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ProfileError(f"{where}: {key} = {value!r}: must be a positive integer")
    for key in (*_FLOAT_KEYS, *optional_floats):
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ProfileError(f"{where}: {key} = {value!r}: must be a positive finite number")
    if raw["max_num_seqs"] > raw["max_num_batched_tokens"]:
        # vLLM rejects this too: every running sequence needs a token of the step budget to decode
        raise ProfileError(f"{where}: max_num_seqs must be <= max_num_batched_tokens")
    sources = {k: raw[f"{k}_source"] for k in (*numbers, *optional, *optional_floats)}
    if "engine" in raw:
        sources["engine"] = raw["engine"]
    return EngineProfile(
        name=raw["name"],
        gpu=raw["gpu"],
        model=raw["model"],
        block_size=int(raw["block_size"]),
        num_gpu_blocks=int(raw["num_gpu_blocks"]),
        max_num_batched_tokens=int(raw["max_num_batched_tokens"]),
        max_num_seqs=int(raw["max_num_seqs"]),
        t0_ms=float(raw["t0_ms"]),
        t_w_ms=float(raw["t_w_ms"]),
        b_ms_per_token=float(raw["b_ms_per_token"]),
        c_ms_per_token_ctx=float(raw["c_ms_per_token_ctx"]),
        e_ms_per_seq=float(raw["e_ms_per_seq"]),
        f_ms_per_ctx_token=float(raw["f_ms_per_ctx_token"]),
        max_model_len=int(raw["max_model_len"]) if "max_model_len" in optional else None,
        t_prefill_ms=float(raw["t_prefill_ms"]) if "t_prefill_ms" in optional_floats else 0.0,
        sources=sources,
    )


def scaled(profile: EngineProfile, **overrides: Any) -> EngineProfile:
    """A copy of `profile` with some fields replaced (tests, what-if runs); validated like a file."""
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile) if f.name != "sources"}
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ProfileError(f"scaled({profile.name}): unknown key {sorted(unknown)[0]!r}")
    fields.update(overrides)
    numbers = (*_INT_KEYS, *_FLOAT_KEYS, *_OPTIONAL_INT_KEYS, *_OPTIONAL_FLOAT_KEYS)
    raw = {**fields, **{f"{k}_source": profile.sources.get(k, "override") for k in numbers}}
    for key in overrides:
        if key in numbers:
            raw[f"{key}_source"] = f"override of {profile.name} ({getattr(profile, key)!r} there)"
    result = _parse(raw, f"scaled({profile.name})")
    return dataclasses.replace(result, sources={**profile.sources, **result.sources})


def step_time_ms(
    profile: EngineProfile, decodes: int, decode_ctx: float, prefill_tokens: int, prefill_attn: float
) -> float:
    """One engine step: `decodes` sequences with Σctx `decode_ctx`, `prefill_tokens` new prompt tokens whose
    attention work Σ n·(ctx + n/2) is `prefill_attn` (ENGINE.md §8)."""
    p = profile
    scheduled = decodes + prefill_tokens
    return (
        (p.t_prefill_ms if prefill_tokens > 0 else 0.0)
        + p.t0_ms
        + max(p.t_w_ms + p.e_ms_per_seq * decodes, p.b_ms_per_token * scheduled)
        + p.c_ms_per_token_ctx * prefill_attn
        + p.f_ms_per_ctx_token * decode_ctx
    )


def prefill_time_s(profile: EngineProfile, new_tokens: int, ctx_tokens: int = 0) -> float:
    """Seconds to prefill `new_tokens` after `ctx_tokens` cached ones on an idle engine, in chunks of
    max_num_batched_tokens (the step that completes the prefill also yields the first token)."""
    if new_tokens <= 0:
        return 0.0
    budget = profile.max_num_batched_tokens
    total_ms = 0.0
    ctx = ctx_tokens
    for _ in range(math.ceil(new_tokens / budget)):
        n = min(budget, ctx_tokens + new_tokens - ctx)
        total_ms += step_time_ms(profile, 0, 0.0, n, n * (ctx + n / 2))
        ctx += n
    return total_ms / 1000.0


def decode_step_s(profile: EngineProfile, batch: int, total_ctx: float) -> float:
    """Seconds of one pure decode step of `batch` sequences holding `total_ctx` context tokens in all."""
    return step_time_ms(profile, batch, total_ctx, 0, 0.0) / 1000.0
