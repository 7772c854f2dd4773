#!/usr/bin/env bash
# Staging recipe: plain mitmdump with kvgate as a `-s` script, in reverse-proxy mode in front of two
# OpenAI-compatible servers (vLLM, SGLang, or `kvgate worker` emulators), no agents: the gateway
# registers the two URLs itself as static workers and health-checks them.
#
#   WORKER_A=http://10.0.0.5:8000 WORKER_B=http://10.0.0.6:8000 examples/staging.sh
#   curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
#        -H 'x-kvgate-priority: high' -d '{"model": "llama", "messages": [{"role": "user", "content": "hi"}]}'
#
# Environment (defaults in brackets): WORKER_A, WORKER_B (required); PORT [8080]; HOST [127.0.0.1];
# CONFIG [examples/kvgate.toml]; REDIS_URL ["" = mitmdump starts a private embedded redis-server];
# MODEL ["" = ask each worker's /v1/models]. Extra arguments go to mitmdump (listening beyond loopback
# for clients with public addresses needs `--set block_global=false`).
# mitmdump reloads `-s` scripts when the file changes (losing the gateway's state): for production
# use `kvgate proxy` (docs/GATEWAY.md), which runs the same addon registered in code.
# tests/e2e/test_examples.py runs this script against two emulated workers.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
: "${WORKER_A:?set WORKER_A to the first worker URL}" "${WORKER_B:?set WORKER_B to the second worker URL}"
exec mitmdump \
  --mode "reverse:http://127.0.0.1:1" \
  --listen-host "${HOST:-127.0.0.1}" --listen-port "${PORT:-8080}" \
  -s "$here/plugin/entry.py" \
  --set connection_strategy=lazy \
  --set kvgate_config="${CONFIG:-$here/examples/kvgate.toml}" \
  --set kvgate_redis_url="${REDIS_URL:-}" \
  --set kvgate_model="${MODEL:-}" \
  --set kvgate_workers="$WORKER_A" --set kvgate_workers="$WORKER_B" \
  "$@"
