"""An emulated vLLM worker: OpenAI-compatible HTTP, vLLM metrics and KV events, driven in real time
by the simulator's engine model (bench/sim/engine.py). Run it with `kvgate worker ...`
(bench/emulator/__main__.py) or in-process with `bench.emulator.server.start_emulator(config)`.

Modules: tokenizer (fake tokenizer, chat template, block keys), openai_api (validation, response
bodies), driver (engine in real time), kv_events (ZMQ publisher), metrics (Prometheus text), worker
(per-server state), completions and endpoints (handlers), server (app assembly, `start_emulator`).
"""
