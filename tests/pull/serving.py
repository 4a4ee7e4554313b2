"""Servers run in a thread of the test process, on 127.0.0.1: any aiohttp app
(:func:`serving`), and a real ``deltastore serve`` (:func:`running_server`) whose metrics
object a test can read too."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from aiohttp import web

from deltastore.pull.server import PullServer, ServerConfig


@contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) until the block ends; yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    found: list[str] = []

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
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
        yield found[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@dataclass
class Running:
    url: str
    server: PullServer


@contextmanager
def running_server(config: ServerConfig) -> Iterator[Running]:
    """A ``deltastore serve`` of ``config`` (bound to 127.0.0.1, a free port)."""
    server = PullServer(replace(config, host="127.0.0.1", port=0))
    with serving(server.app()) as url:
        yield Running(url, server)
