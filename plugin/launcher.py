"""`kvgate proxy`: run mitmdump in reverse mode with the kvgate addon registered in code.

    kvgate proxy [--config FILE] [--listen-host H] [--listen-port P] [--redis URL] [--processes N]
                 [--worker URL ...] [--model M] [--gateway-id ID] [-- MITMDUMP ARGS...]

`KvGateMaster` adds `KvGate` in its constructor (MITMPROXY.md §5), so `--set kvgate_*` work and no
script hot-reload can drop the gateway's state. It sets the defaults a gateway needs before the
command line is parsed (anything after `--` still overrides them): lazy upstream connections, a long
idle timeout for silent generations, no onboarding app, no public-IP block, a private writable
confdir, and a request body limit above the config's own (so kvgate answers most oversize bodies
with its JSON 413). With no --redis the addon starts an embedded redis-server. With --processes N > 1
a supervisor runs N such gateways on the port (SO_REUSEPORT) and one Redis (plugin/supervisor.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from mitmproxy import options
from mitmproxy.tools import cmdline
from mitmproxy.tools.dump import DumpMaster
from mitmproxy.tools.main import run

from plugin.addon import KvGate
from plugin.client_deadline import ClientDeadline
from plugin.config import ConfigError, load_config
from plugin.lean_chain import drop_idle_addons
from plugin.memtrace import start_from_env as start_memtrace
from plugin.supervisor import enable_reuse_port, run_supervisor
from runtime import compat

FALLBACK_UPSTREAM = "http://127.0.0.1:1"  # never used: every request is answered or rerouted
IDLE_TIMEOUT_S = 3600


class KvGateMaster(DumpMaster):
    """mitmdump with the kvgate addon built in and gateway-friendly defaults."""

    log_connections = False

    def __init__(self, opts: options.Options, **kwargs: object) -> None:
        super().__init__(opts, **kwargs)
        # ClientDeadline first: it must see a request as complete before KvGate's hook awaits admission
        self.addons.add(ClientDeadline(), KvGate())
        if not self.log_connections:  # two INFO lines per client connection cost CPU at load
            logging.getLogger("mitmproxy.proxy.server").setLevel(logging.WARNING)
        defaults: dict[str, object] = {
            "connection_strategy": "lazy",
            "onboarding": False,
            "block_global": False,
            "flow_detail": 0,
        }
        if "tcp_timeout" in opts:
            defaults["tcp_timeout"] = IDLE_TIMEOUT_S
        else:  # mitmproxy 11: the idle timeout is a module constant
            import mitmproxy.proxy.server as server

            server.TCP_TIMEOUT = IDLE_TIMEOUT_S  # type: ignore[attr-defined]
        opts.update(**defaults)

    async def running(self) -> None:
        # the command line is applied by now: leave the built-in addons it did not switch on out of the
        # event chain, which every event walks (plugin/lean_chain.py)
        drop_idle_addons(self.addons, self.options)
        await super().running()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="", help="kvgate TOML config (see examples/kvgate.toml)")
    parser.add_argument("--listen-host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--listen-port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--redis", default="", help="Redis URL shared by gateways (default: embedded redis)")
    parser.add_argument(
        "--embedded-redis-port", type=int, default=0,
        help="TCP port of the embedded redis-server (default: a free one; it also listens on a unix "
        "socket at a path stable across restarts, logged at start)",
    )  # fmt: skip
    parser.add_argument("--worker", action="append", default=[], help="static worker URL (repeatable)")
    parser.add_argument("--model", default="", help="model of the static workers (default: their /v1/models)")
    parser.add_argument(
        "--worker-max-concurrency", type=int, default=0, help="per static worker (0: unknown)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9464,
        help="port of /metrics, /healthz and /readyz on their own listener (default 9464; 0: none)",
    )  # fmt: skip
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics port")
    parser.add_argument("--gateway-id", default="", help="this gateway's name (default hostname-pid)")
    parser.add_argument("--confdir", default="", help="mitmproxy confdir (default: a private temp dir)")
    parser.add_argument("--log-connections", action="store_true", help="log every client connect/disconnect")
    parser.add_argument(
        "--processes", type=int, default=1,
        help="gateway processes on this port (SO_REUSEPORT, one event loop each, one Redis; default 1)",
    )  # fmt: skip
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # a supervisor's child
    parser.add_argument("mitmdump_args", nargs="*", help="after --: extra mitmdump arguments")
    return parser


def mitmdump_args(args: argparse.Namespace, confdir: str) -> list[str]:
    max_body = load_config(args.config).limits.max_body_bytes
    sets = {
        "confdir": confdir,
        "body_size_limit": str(2 * max_body),
        "kvgate_config": args.config,
        "kvgate_redis_url": args.redis,
        "kvgate_gateway_id": args.gateway_id,
        "kvgate_embedded_redis_port": str(args.embedded_redis_port),
        "kvgate_model": args.model,
        "kvgate_worker_max_concurrency": str(args.worker_max_concurrency),
        "kvgate_metrics_port": str(args.metrics_port),
        "kvgate_metrics_host": args.metrics_host,
    }
    out = ["--mode", f"reverse:{FALLBACK_UPSTREAM}", "--listen-host", args.listen_host,
           "--listen-port", str(args.listen_port)]  # fmt: skip
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    for url in args.worker:
        out += ["--set", f"kvgate_workers={url}"]
    return out + list(args.mitmdump_args)


def main(argv: list[str] | None = None) -> int:
    compat.install()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        load_config(args.config)
    except ConfigError as e:
        print(f"kvgate proxy: invalid config: {e}", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("kvgate proxy: --processes must be >= 1", file=sys.stderr)
        return 2
    if args.processes > 1:
        return run_supervisor(args)
    if args.reuse_port:
        enable_reuse_port()
    KvGateMaster.log_connections = args.log_connections
    start_memtrace()  # KVGATE_TRACEMALLOC=N: log allocation growth every N s (plugin/memtrace.py)
    with tempfile.TemporaryDirectory(prefix="kvgate-mitm-") as tmp:
        confdir = args.confdir or str(Path(tmp) / "confdir")
        run(KvGateMaster, cmdline.mitmdump, mitmdump_args(args, confdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
