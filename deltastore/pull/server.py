"""``deltastore serve``: the reference ``/pull_weights`` endpoint as a small aiohttp server.

One server per engine host. ``POST /pull_weights {local_checkpoint_dir, source_dir,
target_version}`` pulls into that host-local dir from the store (the engine's model path,
``--base``, is version 0) and answers ``{success, message}`` with 200 or 400; ``GET /state``
reports what a local dir holds; ``GET /healthz`` answers while pulls run (they run in threads).

Safety: binds 127.0.0.1 by default; an optional bearer token (401 without it); request paths
must lie under an ``--allow`` root (403 otherwise), and with no ``--allow`` the server refuses
to bind anything but loopback; a local dir that is, holds or lies inside the base or the source
store is refused (the user's model and published versions are never modified); with ``--allow``
every file of a local source store must resolve inside the allowed roots (a symlink out is
refused); requests for one local dir run one at a time.

Request rules against browsers (:class:`RequestRules`): a web page can make a browser send a
"simple" cross-site POST, and DNS rebinding makes one look same-site; so every request's
``Host`` must name this server (an IP literal, ``localhost``, this machine's names when bound
beyond loopback, or an ``--allow-host`` name), any ``Origin`` must be the server's own, and a
POST must be ``Content-Type: application/json`` (which a page cannot send cross-site without a
preflight this server never grants) and at most :data:`MAX_REQUEST_BYTES` long. Every refusal
and every error is the JSON ``{success, message}`` reply.

Logging (logger ``deltastore.serve``): every refused or failed request (any status from 400
on, a failed pull included) at WARNING with its method, target and reason; a pull that
succeeded at INFO; other successful requests (``/healthz``, ``/state``, ``/metrics``) at DEBUG.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import hmac
import json
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from deltastore.errors import DeltastoreError, FormatError
from deltastore.pull.access import (
    MAX_REQUEST_BYTES,
    PathPolicy,
    RequestRules,
    ServerConfig,
    is_loopback,
)
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.metrics import CONTENT_TYPE, PullMetrics
from deltastore.pull.protocol import CheckpointStatus, PullReply, PullRequest
from deltastore.pull.pull import pull_weights

log = logging.getLogger("deltastore.serve")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PULL_DETAIL = web.RequestKey("pull_detail", str)
"""Set on a request once its pull is parsed: the local dir, version and stores, for the log."""


class PullServer:
    """The request handlers and their shared state (per-dir locks, the pull threads)."""

    def __init__(self, config: ServerConfig) -> None:
        config.check()
        self.config = config
        self.policy = PathPolicy(config)
        self.rules = RequestRules(config)
        self.locks: dict[str, asyncio.Lock] = {}
        self.busy: set[str] = set()
        self.metrics = PullMetrics()
        self.executor = cf.ThreadPoolExecutor(
            config.max_parallel_pulls, thread_name_prefix="deltastore-pull"
        )

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._log_outcome, self._json_errors, self._guard, self._auth],
            client_max_size=MAX_REQUEST_BYTES,
        )
        app.router.add_post("/pull_weights", self.pull_weights)
        app.router.add_get("/state", self.state)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.executor.shutdown, True)

    @web.middleware
    async def _log_outcome(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """One log line per request with its outcome (see the module docstring)."""
        response = await handler(request)
        status = response.status
        level = (
            logging.WARNING
            if status >= 400
            else logging.INFO
            if request.path == "/pull_weights"
            else logging.DEBUG
        )
        if log.isEnabledFor(level):
            what = request.get(PULL_DETAIL)
            target = f"{request.method} {request.path_qs}" + (f" ({what})" if what else "")
            reason = _reply_message(response)
            log.log(level, "%s -> %d%s", target, status, f": {reason}" if reason else "")
        return response

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error (aiohttp's own 404/405/413, a bug's 500) as ``{success, message}``."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._reply(PullReply(False, f"{exc.status} {exc.reason}"), exc.status)
        except Exception as exc:  # a bug must still answer {success, message}
            log.exception("%s %s failed unexpectedly", request.method, request.path)
            return self._reply(PullReply(False, f"unexpected {type(exc).__name__}: {exc}"), 500)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = self.rules.refusal(request)
        if refusal is not None:
            status, message = refusal
            return self._reply(PullReply(False, message), status)
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = self.config.token
        if token is not None and request.path != "/healthz":
            header = request.headers.get("Authorization", "")
            given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
            # Headers are decoded with surrogateescape: this gives back the bytes sent, so a
            # non-UTF-8 header compares unequal instead of raising.
            sent = given.encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, token.encode("utf-8")):
                reply = PullReply(False, "missing or wrong bearer token (Authorization: Bearer)")
                return self._reply(reply, 401)
        return await handler(request)

    @staticmethod
    def _reply(reply: PullReply, status: int | None = None) -> web.Response:
        return web.json_response(reply.to_dict(), status=status or reply.http_status)

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pulls_running": len(self.busy)})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def state(self, request: web.Request) -> web.Response:
        path = request.query.get("local_checkpoint_dir")
        if not path:
            return self._reply(PullReply(False, "pass ?local_checkpoint_dir=ABSOLUTE_PATH"))
        try:
            real = self.policy.local_dir(path)
        except FormatError as exc:
            return self._reply(PullReply(False, str(exc)))
        except PermissionError as exc:
            return self._reply(PullReply(False, str(exc)), 403)
        local = LocalCheckpoint(real)
        busy = real in self.busy

        def read() -> CheckpointStatus:
            # The state reads wait for a flush still running after a pull's reply: off the
            # event loop, so /healthz and other dirs' requests answer meanwhile.
            return CheckpointStatus.of(path, local.read_state(), local.read_pending(), busy=busy)

        status = await asyncio.get_running_loop().run_in_executor(None, read)
        return web.json_response(status.to_dict())

    async def pull_weights(self, request: web.Request) -> web.Response:
        try:
            body = PullRequest.from_json(await request.read())
            local_dir = self.policy.local_dir(body.local_checkpoint_dir)
            # The source check walks a local store: off the event loop, so /healthz answers.
            sources = [
                await asyncio.get_running_loop().run_in_executor(None, self.policy.source, one)
                for one in body.sources
            ]
            for one in sources:
                self.policy.separate(local_dir, one)
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body exceeds {MAX_REQUEST_BYTES} bytes"
            return self._reply(PullReply(False, message), 413)
        except FormatError as exc:
            return self._reply(PullReply(False, str(exc)))
        except PermissionError as exc:
            return self._reply(PullReply(False, str(exc)), 403)
        target = body.target_version
        shown = f"v{target:06d}" if isinstance(target, int) else target
        request[PULL_DETAIL] = f"{local_dir} {shown} from {', '.join(sources)}"
        lock = self.locks.setdefault(local_dir, asyncio.Lock())
        async with lock:  # one pull per local dir at a time; the flock covers other processes
            self.busy.add(local_dir)
            try:
                reply = await asyncio.get_running_loop().run_in_executor(
                    self.executor, functools.partial(self._pull, local_dir, sources, body)
                )
            finally:
                self.busy.discard(local_dir)
        return self._reply(reply)

    def _pull(self, local_dir: str, sources: list[str], body: PullRequest) -> PullReply:
        try:
            result = pull_weights(
                local_dir,
                sources[0] if len(sources) == 1 else sources,
                body.target_version,
                self.config.base_dir,
                storage_options=self.config.storage_options or None,
                pre_read=self.config.pre_read,
                workers=self.config.workers,
                trusted_keys=self.config.trusted_keys,
                # The engine reloads from the page cache: reply once the tensors are verified
                # there; the flush and the state follow (docs/engines.md, "Replying before
                # the flush"), and the next pull of the dir waits for them.
                flush_after_reply=True,
            )
        except (DeltastoreError, OSError) as exc:
            self.metrics.failed(local_dir)
            return PullReply(False, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug must still answer {success, message}
            log.exception("pull of %s failed unexpectedly", local_dir)
            self.metrics.failed(local_dir)
            return PullReply(False, f"unexpected {type(exc).__name__}: {exc}")
        self.metrics.pulled(local_dir, result)
        return PullReply(True, result.message)


def _reply_message(response: web.StreamResponse) -> str | None:
    """The ``message`` of a ``{success, message}`` reply, if ``response`` is one."""
    body = getattr(response, "body", None)
    if not isinstance(body, bytes) or not body.startswith(b"{"):
        return None
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        return None
    return message if isinstance(message, str) else None


async def serve_async(
    config: ServerConfig,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM); ``ready(url)`` once listening."""
    server = PullServer(config)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        if ready is not None:
            ready(url)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(config: ServerConfig, ready: Callable[[str], None] | None = None) -> None:
    """Blocking :func:`serve_async`."""
    asyncio.run(serve_async(config, ready))


__all__ = [
    "MAX_REQUEST_BYTES",
    "PathPolicy",
    "PullServer",
    "RequestRules",
    "ServerConfig",
    "is_loopback",
    "serve",
    "serve_async",
]
