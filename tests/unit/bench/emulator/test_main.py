"""`kvgate worker` arguments: a bad value is an error naming it, never a quiet default."""

from __future__ import annotations

import pytest

from bench.emulator.__main__ import main, parse_args


def test_arguments_become_the_config() -> None:
    config = parse_args(
        ["--port", "0", "--model", "m", "--served-model-name", "alias", "--time-scale", "0.1",
         "--num-gpu-blocks", "2000", "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--worker-id", "w3",
         "--stream-interval-ms", "5"]
    )  # fmt: skip
    assert config.models == ("m", "alias")
    assert (config.port, config.time_scale, config.num_gpu_blocks) == (0, 0.1, 2000)
    assert (config.kv_events_endpoint, config.worker_id, config.stream_interval_s) == (
        "tcp://127.0.0.1:5557",
        "w3",
        0.005,
    )
    assert config.engine_profile().num_gpu_blocks == 2000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--time-scale", "0"], "time_scale must be > 0", id="zero time scale"),
        pytest.param(["--num-gpu-blocks", "-1"], "num_gpu_blocks must be > 0", id="negative pool"),
        pytest.param(["--stream-interval-ms", "0"], "stream_interval_s must be > 0", id="zero interval"),
        pytest.param(["--port", "x"], "invalid int value", id="port not a number"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_profile_fails_before_binding(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--profile", "no-such-gpu", "--port", "0"]) == 2
    assert "unknown profile 'no-such-gpu'" in capsys.readouterr().err
