"""`kvgate worker`: run one emulated vLLM worker until SIGINT/SIGTERM.

    kvgate worker --port 8001 --model llama --profile h100-llama3.1-8b --time-scale 1.0 \\
        [--kv-events-endpoint tcp://127.0.0.1:5557] [--worker-id w0] [--num-gpu-blocks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from bench.emulator.server import EmulatorConfig, start_emulator
from bench.sim.profiles import ProfileError, list_profiles


def parse_args(argv: list[str]) -> EmulatorConfig:
    parser = argparse.ArgumentParser(prog="kvgate worker", description="An emulated vLLM worker.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = a free port (printed at start)")
    parser.add_argument("--model", default="emulated-model", help="served model name")
    parser.add_argument(
        "--served-model-name", action="append", default=[], help="another name for the model (repeatable)"
    )
    parser.add_argument(
        "--profile", default="h100-llama3.1-8b", help=f"engine profile: {', '.join(list_profiles())}"
    )
    parser.add_argument("--num-gpu-blocks", type=int, help="override the profile's KV pool (blocks)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="wall seconds per modelled second (0.1 = 10x faster)"
    )
    parser.add_argument("--worker-id", default="emulator", help="names this worker in the KV-event topic")
    parser.add_argument("--kv-events-endpoint", help="bind a ZMQ PUB socket here, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--kv-events-topic", help="default kv@<worker-id>@<model>")
    parser.add_argument(
        "--lora-adapter", action="append", default=[], help="serve this name as a LoRA adapter (repeatable)"
    )
    parser.add_argument(
        "--kv-events-replay-endpoint", help="bind vLLM's replay ROUTER socket here (lost batches on request)"
    )
    parser.add_argument("--default-max-tokens", type=int, default=64, help="output length without max_tokens")
    parser.add_argument("--max-model-len", type=int, default=131_072)
    parser.add_argument(
        "--stream-interval-ms", type=float, default=20.0, help="flush decoded tokens at most this often"
    )
    parser.add_argument(
        "--tokenizer", help="model directory (tokenizer.json, tokenizer_config.json): real ids, template"
    )
    args = parser.parse_args(argv)
    try:
        return EmulatorConfig(
            model=args.model,
            extra_model_names=tuple(n for n in args.served_model_name if n != args.model),
            profile=args.profile,
            num_gpu_blocks=args.num_gpu_blocks,
            time_scale=args.time_scale,
            host=args.host,
            port=args.port,
            worker_id=args.worker_id,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_events_topic=args.kv_events_topic,
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            lora_adapters=tuple(args.lora_adapter),
            default_max_tokens=args.default_max_tokens,
            max_model_len=args.max_model_len,
            stream_interval_s=args.stream_interval_ms / 1000,
            tokenizer=args.tokenizer,
        )
    except ValueError as e:
        parser.error(str(e))


async def serve(config: EmulatorConfig) -> None:
    runner, port = await start_emulator(config)
    print(f"kvgate worker {config.worker_id}: http://{config.host}:{port} model {config.model}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config.engine_profile()  # fail before binding anything
    except ProfileError as e:
        print(f"kvgate worker: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as e:
        print(f"kvgate worker: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
