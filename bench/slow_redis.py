"""A TCP proxy in front of redis-server that delays Redis's replies by a delay set at run time (the
chaos benchmark's "slow Redis" fault). It runs its own event loop on a thread, so processes started
before the load (gateways, agents) can connect to it. A closed upstream (Redis killed) closes the
client's side too, as a dead Redis would; the next connection reaches the restarted Redis."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from store.redis_server import free_port


class SlowRedisProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.delay_s = 0.0  # added before each chunk of Redis's replies is passed on
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-redis-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> SlowRedisProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        up = asyncio.ensure_future(self._pipe(client_r, redis_w, delayed=False))
        down = asyncio.ensure_future(self._pipe(redis_r, client_w, delayed=True))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for writer in (client_w, redis_w):
            writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if delayed and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
