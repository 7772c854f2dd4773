"""Calibration profiles: the shipped files load, cite a source for every number, and reproduce the
predictions of shared/reference/ENGINE.md §8; broken files fail with the file and key named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.sim.profiles import (
    EngineProfile,
    ProfileError,
    decode_step_s,
    list_profiles,
    load_profile,
    prefill_time_s,
    scaled,
    step_time_ms,
)

SHIPPED = ["h100-llama3.1-8b", "h100-qwen3-32b-fp8", "h200x4-llama3.1-70b"]
NUMBERS = [
    "block_size",
    "num_gpu_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "t0_ms",
    "t_w_ms",
    "b_ms_per_token",
    "c_ms_per_token_ctx",
    "e_ms_per_seq",
    "f_ms_per_ctx_token",
]


def test_shipped_profiles_are_listed() -> None:
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_cites_a_source(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    for key in NUMBERS:
        assert getattr(profile, key) > 0
        assert len(profile.sources[key]) > 20, key


@pytest.mark.parametrize(
    ("name", "capacity_tokens"),
    [
        pytest.param("h100-llama3.1-8b", 27284 * 16, id="8b: 27,284 blocks of 16"),
        pytest.param("h100-qwen3-32b-fp8", 4485 * 64, id="q32: 4,485 blocks of 64"),
        pytest.param("h200x4-llama3.1-70b", 73662 * 16, id="70b tp4: ~74k blocks of 16"),
    ],
)
def test_capacity_tokens(name: str, capacity_tokens: int) -> None:
    assert load_profile(name).capacity_tokens == capacity_tokens


# ENGINE.md §8 "Predictions [D]" (rounded there to the ms)
@pytest.mark.parametrize(
    ("name", "new_tokens", "ctx_tokens", "expected_ms"),
    [
        pytest.param("h100-llama3.1-8b", 512, 0, 12, id="8b fresh 512"),
        pytest.param("h100-llama3.1-8b", 2048, 0, 49, id="8b fresh 2k"),
        pytest.param("h100-llama3.1-8b", 8192, 0, 220, id="8b fresh 8k"),
        pytest.param("h100-llama3.1-8b", 32768, 0, 1304, id="8b fresh 32k in 4 chunks"),
        pytest.param("h100-llama3.1-8b", 2048, 8192, 66, id="8b 2k chunk after 8k"),
        pytest.param("h100-llama3.1-8b", 2048, 65536, 191, id="8b 2k chunk after 64k"),
        pytest.param("h100-qwen3-32b-fp8", 2048, 0, 140, id="q32 fresh 2k"),
        pytest.param("h100-qwen3-32b-fp8", 8192, 0, 660, id="q32 fresh 8k"),
        pytest.param("h100-qwen3-32b-fp8", 8596, 0, 700, id="q32 mean tool&agent request"),
    ],
)
def test_prefill_matches_engine_md(name: str, new_tokens: int, ctx_tokens: int, expected_ms: float) -> None:
    got_ms = prefill_time_s(load_profile(name), new_tokens, ctx_tokens) * 1000
    assert got_ms == pytest.approx(expected_ms, rel=0.03, abs=1.0)


@pytest.mark.parametrize(
    ("name", "batch", "ctx_each", "expected_ms"),
    [
        pytest.param("h100-llama3.1-8b", 1, 1024, 7.1, id="8b B=1 ctx 1k"),
        pytest.param("h100-llama3.1-8b", 64, 1024, 11.6, id="8b B=64 ctx 1k"),
        pytest.param("h100-llama3.1-8b", 256, 1024, 25.5, id="8b B=256 ctx 1k"),
        pytest.param("h100-llama3.1-8b", 128, 8192, 67.6, id="8b B=128 ctx 8k"),
        pytest.param("h100-qwen3-32b-fp8", 1, 8192, 16.5, id="q32 B=1 ctx 8k"),
        pytest.param("h100-qwen3-32b-fp8", 64, 8192, 47.3, id="q32 B=64 ctx 8k"),
    ],
)
def test_decode_matches_engine_md(name: str, batch: int, ctx_each: int, expected_ms: float) -> None:
    got_ms = decode_step_s(load_profile(name), batch, batch * ctx_each) * 1000
    assert got_ms == pytest.approx(expected_ms, abs=0.1)


def test_prefill_of_nothing_costs_nothing() -> None:
    assert prefill_time_s(load_profile("h100-llama3.1-8b"), 0) == 0.0


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broken.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _good_text() -> str:
    return (Path(__file__).parents[3] / "bench/sim/profiles/h100-llama3.1-8b.toml").read_text(
        encoding="utf-8"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda t: t + "\nbogus = 1\n", "unknown key 'bogus'", id="unknown key"),
        pytest.param(lambda t: t.replace("t0_ms = 0.6\n", ""), "missing key 't0_ms'", id="missing number"),
        pytest.param(
            lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith("t_w_ms_source")),
            "missing key 't_w_ms_source'",
            id="number without a source",
        ),
        pytest.param(lambda t: t.replace("t_w_ms = 6.4", "t_w_ms = 0"), "t_w_ms = 0", id="zero coefficient"),
        pytest.param(
            lambda t: t.replace("num_gpu_blocks = 27284", "num_gpu_blocks = -5"),
            "num_gpu_blocks = -5",
            id="negative blocks",
        ),
        pytest.param(
            lambda t: t.replace("block_size = 16", "block_size = 16.5"),
            "block_size = 16.5",
            id="fractional int",
        ),
        pytest.param(
            lambda t: t.replace("max_num_seqs = 1024", "max_num_seqs = 9000"),
            "max_num_seqs must be <= max_num_batched_tokens",
            id="more seqs than token budget",
        ),
        pytest.param(lambda t: t + "\n[[[", "not valid TOML", id="syntax error"),
    ],
)
def test_broken_file_names_file_and_key(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = _write(tmp_path, edit(_good_text()))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_unknown_profile_name_lists_shipped() -> None:
    with pytest.raises(ProfileError, match=r"h100-llama3\.1-8b"):
        load_profile("no-such-gpu")


def test_scaled_replaces_and_validates() -> None:
    base = load_profile("h100-llama3.1-8b")
    small = scaled(base, num_gpu_blocks=100, max_num_seqs=4)
    assert isinstance(small, EngineProfile)
    assert (small.num_gpu_blocks, small.max_num_seqs, small.t_w_ms) == (100, 4, base.t_w_ms)
    assert small.sources["num_gpu_blocks"] == "override of h100-llama3.1-8b (27284 there)"
    assert small.sources["t_w_ms"] == base.sources["t_w_ms"]
    with pytest.raises(ProfileError, match="num_gpu_blocks"):
        scaled(base, num_gpu_blocks=0)
    with pytest.raises(ProfileError, match="nope"):
        scaled(base, nope=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.num_gpu_blocks = 5  # type: ignore[misc]


def test_t_prefill_is_charged_once_per_step_with_prompt_tokens(tmp_path: Path) -> None:
    base = load_profile("h100-llama3.1-8b")
    assert base.t_prefill_ms == 0.0  # absent: every profile but the mocker's keeps its step times
    text = _good_text() + '\nt_prefill_ms = 10.0\nt_prefill_ms_source = "a per-prefill-step constant"\n'
    with_it = load_profile(_write(tmp_path, text))
    assert with_it.t_prefill_ms == 10.0
    assert step_time_ms(with_it, 4, 4096, 0, 0.0) == step_time_ms(base, 4, 4096, 0, 0.0)
    assert step_time_ms(with_it, 4, 4096, 100, 5000.0) == pytest.approx(
        step_time_ms(base, 4, 4096, 100, 5000.0) + 10.0
    )
    assert scaled(with_it, num_gpu_blocks=100).t_prefill_ms == 10.0
    with pytest.raises(ProfileError, match="missing key 't_prefill_ms_source'"):
        load_profile(_write(tmp_path, _good_text() + "\nt_prefill_ms = 10.0\n"))
    with pytest.raises(ProfileError, match="t_prefill_ms = -1"):
        load_profile(_write(tmp_path, text.replace("t_prefill_ms = 10.0", "t_prefill_ms = -1")))


def _mocker_prefill_ms(tokens: int) -> float:
    """NVIDIA Dynamo 1.6.1's mocker, polynomial timing: one request alone, chunks of 8,192 tokens."""
    chunks = [min(8192, tokens - k) for k in range(0, tokens, 8192)]
    return sum(16.50142 + 0.01518344 * n + 4.209989e-07 * n * n for n in chunks)


@pytest.mark.parametrize(
    ("tokens", "rel"),
    [(512, 0.09), (2048, 0.11), (4096, 0.07), (8192, 0.02), (16384, 0.02), (40960, 0.02)],
)
def test_the_mocker_profile_prefills_as_the_mocker(tokens: int, rel: float) -> None:
    got_ms = prefill_time_s(load_profile("dynamo-mocker-1.6.1"), tokens) * 1000
    assert got_ms == pytest.approx(_mocker_prefill_ms(tokens), rel=rel)


@pytest.mark.parametrize("ctx_tokens", [1024, 8192, 43_654])  # p = ctx / 436,544 tokens up to 0.1
def test_the_mocker_profile_decodes_as_the_mocker(ctx_tokens: int) -> None:
    p = ctx_tokens / (27284 * 16)
    mocker_ms = 5.74 + 54.01 * p - 25.74 * p * p
    got_ms = decode_step_s(load_profile("dynamo-mocker-1.6.1"), 1, ctx_tokens) * 1000
    assert got_ms == pytest.approx(mocker_ms, abs=0.27)
