"""`kvgate agent`: run the node agent beside one worker until it is drained or stopped.

    kvgate agent --worker-url http://127.0.0.1:8001 --model NAME --redis redis://127.0.0.1:6379/0 \
        [--worker-id ID] [--heartbeat-ms 1000] [--lease-periods 4] [--kv-events tcp://127.0.0.1:5557]

Exit codes: 0 drained (deregistered after its requests finished) or stopped by SIGTERM/SIGINT (the
worker is deregistered); 1 internal error (the lease is left to expire); 2 bad arguments.
See docs/AGENT.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from agent.app import AGENT, create_app
from agent.config import AgentConfig, ConfigError, parse_args
from runtime import compat

logger = logging.getLogger("kvgate.agent")


async def serve(config: AgentConfig) -> int:
    """Serve the agent until it finishes; returns the exit code."""
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.listen_host, config.listen_port)
        await site.start()
        host, port = runner.addresses[0][:2]
        agent = app[AGENT]
        logger.info(
            "agent for %s listening on http://%s:%s (/healthz, /metrics)", config.base_url, host, port
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stopped = asyncio.ensure_future(stop.wait())
        finished = asyncio.ensure_future(agent.done.wait())
        await asyncio.wait({stopped, finished}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        finished.cancel()
        if not agent.done.is_set() and agent.keeper.registered:
            try:
                await asyncio.wait_for(agent.finish("agent stopped"), timeout=5)
            except Exception as e:  # the lease expires on its own if Redis is unreachable
                logger.warning("could not deregister on stop: %s", e)
        return agent.exit_code
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    compat.install()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(f"kvgate agent: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
