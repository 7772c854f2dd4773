"""WEKA (kv-cache-tester) traces: 64-token ids chained into 512-token blocks, per-file id scope,
sub-agents, caps, seeded choices, and the same result from a directory and from a tar of it."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from bench.sim.cli import main
from bench.sim.traces import TraceError, WekaOptions, load_weka

SHIPPED = Path("/work/shared/traces/weka_agentic_coding/traces.tar.gz")
ALL = WekaOptions(conversations=None, window_s=0.0, duration_s=None)


def call(t: float, tokens: int, ids: list[int] | None = None, out: int = 10) -> dict[str, object]:
    return {"t": t, "type": "n", "in": tokens, "out": out, "hash_ids": ids or list(range(tokens // 64))}


def write(directory: Path, name: str, requests: list[dict[str, object]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"id": name, "block_size": 64, "hash_id_scope": "local", "requests": requests}
    (directory / f"{name}.json").write_text(json.dumps(doc))


def test_ids_chain_into_512_token_blocks_with_a_shorter_last_block(tmp_path: Path) -> None:
    # 1,100 tokens = 17 full 64-token blocks + 12 tail tokens -> 512 + 512 + 76
    write(tmp_path, "a", [call(0.0, 1100), call(5.0, 1024 + 512)])
    first, second = load_weka(tmp_path, ALL)
    assert first.block_tokens == (512, 512, 76)
    assert second.block_tokens == (512, 512, 512)
    assert second.block_ids[:2] == first.block_ids[:2]  # same 16 leading ids -> same two blocks
    assert second.block_ids[2] != first.block_ids[2]  # the first request's tail is its own content
    assert (first.arrival_s, second.arrival_s) == (0.0, 5.0)


def test_a_diverging_64_token_id_changes_its_block_and_every_later_one(tmp_path: Path) -> None:
    ids = list(range(24))
    changed = [*ids[:10], 99, *ids[11:]]
    write(tmp_path, "a", [call(0.0, 1536, ids), call(1.0, 1536, changed)])
    a, b = load_weka(tmp_path, ALL)
    assert a.block_ids[0] == b.block_ids[0]
    assert a.block_ids[1] != b.block_ids[1] and a.block_ids[2] != b.block_ids[2]


def test_local_ids_are_scoped_to_their_file(tmp_path: Path) -> None:
    write(tmp_path, "a", [call(0.0, 1024, list(range(16)))])
    write(tmp_path, "b", [call(0.0, 1024, list(range(16)))])
    a, b = load_weka(tmp_path, ALL)
    assert not set(a.block_ids) & set(b.block_ids)


def test_sub_agents_replay_at_their_start_plus_their_own_t_sharing_the_file_scope(tmp_path: Path) -> None:
    sub = {"t": 100.0, "type": "subagent", "requests": [call(0.0, 512, list(range(8))), call(7.0, 640)]}
    write(tmp_path, "a", [call(0.0, 1024, list(range(16))), sub, call(150.0, 2048)])
    reqs = load_weka(tmp_path, ALL)
    assert [r.arrival_s for r in reqs] == [0.0, 100.0, 107.0, 150.0]
    assert reqs[1].block_ids[0] == reqs[0].block_ids[0]  # same ids in the same file: same content
    assert [r.id for r in reqs] == [0, 1, 2, 3]


def test_caps_drop_long_requests_and_the_end_of_long_conversations(tmp_path: Path) -> None:
    write(tmp_path, "a", [call(0.0, 1000, out=24), call(10.0, 2000), call(4000.0, 1000)])
    options = WekaOptions(conversations=None, window_s=0.0, max_context=1024, duration_s=3600.0)
    assert [(r.input_tokens, r.arrival_s) for r in load_weka(tmp_path, options)] == [(1000, 0.0)]
    options = WekaOptions(conversations=None, window_s=0.0, max_context=1023, duration_s=3600.0)
    with pytest.raises(TraceError, match="no request is left"):
        load_weka(tmp_path, options)  # 1000 in + 24 out > 1023


def test_choice_and_offsets_are_seeded_and_skip_conversations_the_caps_empty(tmp_path: Path) -> None:
    for i in range(10):
        write(tmp_path, f"c{i}", [call(0.0, 512 * (i + 1)), call(30.0, 512 * (i + 1) + 64)])
    options = WekaOptions(conversations=4, window_s=600.0, max_context=512 * 8, seed=7)
    once, again = load_weka(tmp_path, options), load_weka(tmp_path, options)
    assert once == again
    assert len(once) == 8 and all(r.input_tokens <= 512 * 8 for r in once)
    other = load_weka(tmp_path, WekaOptions(conversations=4, window_s=600.0, max_context=512 * 8, seed=8))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in once]
    assert max(r.arrival_s for r in once) < 600.0 + 30.0


def test_a_tar_of_the_directory_gives_the_same_requests(tmp_path: Path) -> None:
    directory = tmp_path / "traces"
    for i in range(3):
        write(directory, f"t{i}", [call(0.0, 700 + i), call(12.5, 1400 + i)])
    archive = tmp_path / "traces.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(directory, arcname="traces")
    options = WekaOptions(conversations=2, window_s=60.0, seed=3)
    assert load_weka(archive, options) == load_weka(directory, options)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param(b"{nope", "not valid JSON", id="broken json"),
        pytest.param(b'{"requests": 3}', "'requests' list", id="no requests list"),
        pytest.param(b'{"block_size": 16, "requests": []}', "block_size 16", id="other block size"),
        pytest.param(
            json.dumps({"requests": [call(0.0, 640, [1, 2])]}).encode(), r"640 // 64 = 10", id="id count"
        ),
        pytest.param(json.dumps({"requests": [{"t": -1}]}).encode(), "'t' must be", id="negative t"),
    ],
)
def test_bad_files_are_named_in_the_error(tmp_path: Path, doc: bytes, message: str) -> None:
    (tmp_path / "bad.json").write_bytes(doc)
    with pytest.raises(TraceError, match=message) as info:
        load_weka(tmp_path, ALL)
    assert "bad.json" in str(info.value)


def test_missing_source_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no trace JSON files"):
        load_weka(tmp_path, ALL)
    with pytest.raises(TraceError, match="no such directory or tar"):
        load_weka(tmp_path / "absent.tar.gz", ALL)


@pytest.mark.skipif(not SHIPPED.is_file(), reason="shipped WEKA traces not present")
def test_the_shipped_tarball_loads_with_its_published_hit_rate() -> None:
    from bench.sim.bounds import infinite_cache_hit_rate

    reqs = load_weka(SHIPPED, WekaOptions(conversations=12, max_context=131_072, seed=1))
    assert len(reqs) > 100
    assert all(r.input_tokens + r.output_tokens <= 131_072 for r in reqs)
    assert all(sum(r.block_tokens) == r.input_tokens for r in reqs)
    assert max(r.arrival_s for r in reqs) <= 1800.0 + 3600.0
    assert infinite_cache_hit_rate(reqs) > 0.85  # the README's per-conversation median is 96.9 %


def test_cli_replays_a_weka_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(4):
        write(tmp_path / "w", f"t{i}", [call(10.0 * k, 1024 + 64 * k) for k in range(6)])
    out = tmp_path / "out"
    argv = ["--trace", str(tmp_path / "w"), "--trace-format", "weka", "--policies", "round_robin,kvgate"]
    assert main([*argv, "--workers", "2", "--out", str(out), "--no-plots", "--jobs", "1"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["requests"] == 24 and {r["policy"] for r in doc["runs"]} == {"round_robin", "kvgate"}
    capsys.readouterr()


def test_each_conversation_is_one_session_closed_by_its_last_call(tmp_path: Path) -> None:
    sub = {"t": 5.0, "type": "subagent", "requests": [call(0.0, 512)]}
    write(tmp_path, "a", [call(0.0, 1024), sub, call(9.0, 2048)])
    write(tmp_path, "b", [call(1.0, 1024)])
    reqs = load_weka(tmp_path, ALL)
    by_session: dict[str, list[bool]] = {}
    for r in reqs:
        assert r.session is not None
        by_session.setdefault(r.session, []).append(r.session_close)
    assert sorted(by_session.values()) == [[False, False, True], [True]]  # sub-agents share the session
