"""A real ``deltastore serve`` (its aiohttp app, bound to 127.0.0.1) run in a thread of the
test process, so a test can read its metrics object too."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from aiohttp import web

from deltastore.pull.server import PullServer, ServerConfig


@dataclass
class Running:
    url: str
    server: PullServer


@contextmanager
def running_server(config: ServerConfig) -> Iterator[Running]:
    """Serve ``config`` (any port: 0 is picked) until the block ends."""
    config = replace(config, host="127.0.0.1", port=0)
    server = PullServer(config)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    found: list[str] = []

    async def main() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        found.append(f"http://{host}:{port}")
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield Running(found[0], server)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
