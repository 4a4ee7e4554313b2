"""``deltastore serve``: the reference ``/pull_weights`` endpoint as a small aiohttp server.

One server per engine host: ``POST /pull_weights`` pulls into a host-local dir (the engine's
model path, ``--base``, is version 0); ``GET /state``, ``GET /healthz`` (answers while pulls
run in threads) and ``GET /metrics`` (Prometheus text, :class:`PullMetrics`).

Safety: binds 127.0.0.1 by default, anything else only with ``--allow``; an optional bearer
token (401); request paths must lie under an ``--allow`` root (403), every file of a local
source store too; a local dir that is, holds or lies inside the base or the source store is
refused; requests for one local dir run one at a time. Against browsers (a page can make one
send a "simple" cross-site POST, and DNS rebinding makes it look same-site),
:class:`RequestRules` wants a ``Host`` naming this server, no foreign ``Origin`` and a JSON
POST (which a page cannot send cross-site without a preflight this server never grants).
Every refusal and error is a ``{success, message}`` reply, logged (``deltastore.serve``) at
WARNING; a pull that succeeded at INFO, the rest at DEBUG.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltastore.errors import ConfigError, DeltastoreError, FormatError
from deltastore.pull.client import CheckpointStatus, PullReply, PullRequest, check_request_path
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.pull import pull_weights
from deltastore.pull.result import PullResult
from deltastore.pull.source import PreRead, overlaps

log = logging.getLogger("deltastore.serve")

MAX_REQUEST_BYTES = 64 * 1024
"""Largest request body accepted (413 above): a pull request is three short fields."""


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one ``deltastore serve`` process."""

    base_dir: str
    """The engine's model path: version 0, copied when a local dir is seeded, never modified."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (the bound URL is reported once listening)."""
    allow: tuple[str, ...] = ()
    """Roots request paths must lie under: directories, or URL prefixes (``s3://bucket/``)."""
    token: str | None = None
    """Bearer token every request but ``/healthz`` must carry."""
    allowed_hosts: tuple[str, ...] = ()
    """Extra names a request's ``Host`` may carry (IP literals and ``localhost`` always pass)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    pre_read: PreRead | None = None
    workers: int = 4
    max_parallel_pulls: int = 4
    """Pulls of different local dirs that may run at once."""
    trusted_keys: tuple[Any, ...] | None = None
    """Public keys (files or :class:`~deltastore.trust.TrustedKey`) every pull requires a
    signature from (``--trust``)."""

    def check(self) -> None:
        """Refuse unsafe or broken settings before anything binds (:class:`ConfigError`)."""
        if not os.path.isdir(self.base_dir):
            raise ConfigError(f"--base {self.base_dir!r} is not a directory (the engine's model)")
        if not self.allow and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to serve on {self.host} without --allow: any host that can reach it "
                "could make this one write anywhere. Pass --allow DIR (repeatable) or bind "
                "127.0.0.1"
            )
        if self.token is not None and not self.token.strip():
            raise ConfigError("the token is empty; put a secret in --token-file")


def _split_host(header: str) -> str:
    """The host of a ``Host`` header, lower case, without the port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    host = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return host.rstrip(".")  # "localhost." is the same name as "localhost"


class RequestRules:
    """Which ``Host`` / ``Origin`` / content type a request may carry (403, 415, 413 otherwise);
    an IP literal in ``Host`` always passes (DNS rebinding needs a name, and a page served from
    another address or port of this machine is caught by its ``Origin``)."""

    def __init__(self, config: ServerConfig) -> None:
        names = {"localhost", *(h.lower() for h in config.allowed_hosts)}
        if not is_loopback(config.host):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower(), config.host.lower()}
        self.names = frozenset(names)

    def refusal(self, request: web.Request) -> tuple[int, str] | None:
        """``(status, message)`` when the request breaks a rule, None when it may proceed."""
        host_header = request.headers.get("Host")
        host = _split_host(host_header) if host_header is not None else None
        if host is not None and host not in self.names and _ip(host) is None:
            return 403, (
                f"Host {host_header!r} does not name this server (DNS rebinding?); call it by "
                "IP address or localhost, or start it with --allow-host NAME"
            )
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower().rstrip("/") != f"http://{host_header}".lower():
            return 403, f"cross-origin request from Origin {origin!r} refused"
        if request.method == "POST":
            if request.content_type != "application/json":
                return 415, (
                    f"Content-Type {request.headers.get('Content-Type')!r} refused: send the "
                    "request body as Content-Type: application/json"
                )
            length = request.content_length
            if length is not None and length > MAX_REQUEST_BYTES:
                return 413, f"request body of {length} bytes exceeds {MAX_REQUEST_BYTES} bytes"
        return None


class PathPolicy:
    def __init__(self, config: ServerConfig) -> None:
        self.base = os.path.realpath(config.base_dir)
        self.dirs = tuple(os.path.realpath(_local_path(a)) for a in config.allow if not _is_url(a))
        self.urls = tuple(a.rstrip("/") for a in config.allow if _is_url(a))
        self.open = not config.allow

    def local_dir(self, path: str) -> str:
        """The real path of a request's local dir; :class:`PermissionError` if not allowed."""
        check_request_path(path, "local_checkpoint_dir")
        if _is_url(path) or not os.path.isabs(_local_path(path)):
            raise FormatError(f"local_checkpoint_dir {path!r} must be an absolute local path")
        real = os.path.realpath(_local_path(path))
        if overlaps(real, self.base):
            raise PermissionError(
                f"local_checkpoint_dir {path!r} is, holds or lies inside the base model "
                f"{self.base}; the base is never modified: pass a separate host-local dir"
            )
        if not self.open and not self._allowed(real):
            raise PermissionError(f"{path!r} is not under an allowed root {list(self.dirs)}")
        return real

    def source(self, source: str) -> str:
        """A request's source (dir or URL) under the allowed roots, every file of a local store
        too (walked now; docs/engines.md names the race this leaves)."""
        check_request_path(source, "source_dir")
        if self.open:
            return source
        if _is_url(source):
            if any(source == u or source.startswith(u + "/") for u in self.urls):
                return source
            raise PermissionError(f"source {source!r} is not under an allowed URL {self.urls}")
        path = _local_path(source)
        real = os.path.realpath(path)
        if not os.path.isabs(path) or not self._allowed(real):
            raise PermissionError(f"source {source!r} is not under an allowed root {self.dirs}")
        self._check_links(real, source)
        return real

    @staticmethod
    def separate(local_dir: str, source: str) -> None:
        """Refuse a local dir that is, holds or lies inside a local source store."""
        if _is_url(source):
            return
        store = os.path.realpath(_local_path(source))
        if overlaps(local_dir, store):
            raise PermissionError(
                f"local_checkpoint_dir {local_dir!r} is, holds or lies inside the source store "
                f"{store}; pulling there would overwrite published versions: pass a host-local "
                "dir outside the store"
            )

    def _allowed(self, real: str) -> bool:
        return any(os.path.commonpath([real, root]) == root for root in self.dirs)

    def _check_links(self, store: str, shown: str) -> None:
        seen: set[str] = set()
        for top, dirs, files in os.walk(store, followlinks=True):
            real_top = os.path.realpath(top)
            if real_top in seen:  # a link loop or a second link to one dir: walked already
                dirs[:] = []
                continue
            seen.add(real_top)
            for name in (*dirs, *files):
                path = os.path.join(top, name)
                if os.path.islink(path) and not self._allowed(os.path.realpath(path)):
                    raise PermissionError(
                        f"{path} in source store {shown!r} is a symlink to "
                        f"{os.path.realpath(path)}, outside the allowed roots {list(self.dirs)}; "
                        "refusing to read it"
                    )


PHASE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of the phase histograms: a no-op pull to a slow reseed."""

_COUNTERS = (
    ("bytes_read", "wire_bytes", "Bytes read from the store by pulls."),
    (
        "bytes_reconstructed",
        "reconstructed_bytes",
        "Bytes of local tensors written by pulls (patched, restored, reseeded).",
    ),
    ("tensors_applied", "tensors_applied", "Local tensors written by pulls."),
    ("tensors_skipped", "tensors_skipped", "Local tensors pulls left as they were (unchanged)."),
    ("reseeds", "reseeds", "Pulls that reseeded the local checkpoint."),
)
"""``deltastore_pull_<name>`` counters: the :class:`PullResult` field each one adds up."""


class PullMetrics:
    """The pulls one server ran (a registry per server; the names without ``deltastore_`` are
    the keys a trainer reads from ``pop_metrics()`` where the quantity exists there)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.pulls = Counter("deltastore_pulls", "Pulls run, by outcome.", ["outcome"], registry=r)
        self.counters = {
            key: Counter(f"deltastore_pull_{name}", text, registry=r)
            for key, name, text in _COUNTERS
        }
        self.phase_seconds = Histogram(
            "deltastore_pull_phase_seconds",
            "Seconds per pull phase (prepare, reseed, apply, total).",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.version = Gauge(
            "deltastore_checkpoint_version",
            "The verified version each local checkpoint holds.",
            ["local_checkpoint_dir"],
            registry=r,
        )
        for outcome in ("noop", "applied", "reseeded", "repaired", "failed"):
            self.pulls.labels(outcome)  # every outcome shows from the start, at 0

    def pulled(self, local_dir: str, result: PullResult) -> None:
        self.pulls.labels(result.action).inc()
        for key, counter in self.counters.items():
            counter.inc(getattr(result, key))
        for phase, seconds in result.phase_seconds.items():
            self.phase_seconds.labels(phase).observe(seconds)
        self.phase_seconds.labels("total").observe(result.seconds)
        self.version.labels(local_dir).set(result.version)

    def failed(self, local_dir: str) -> None:
        """Count a failed pull; the gauge shows what the local dir holds after it (a failed
        pull keeps or puts back its verified version; no state: the gauge goes)."""
        self.pulls.labels("failed").inc()
        try:
            state = LocalCheckpoint(local_dir).read_state()
        except (DeltastoreError, OSError):
            state = None
        if state is not None:
            self.version.labels(local_dir).set(state.version)
        else:
            with contextlib.suppress(KeyError):
                self.version.remove(local_dir)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PULL_DETAIL = web.RequestKey("pull_detail", str)
"""Set on a request once its pull is parsed: the local dir, version and stores, for the log."""
MESSAGE = web.ResponseKey("message", str)
"""Set on every ``{success, message}`` reply: its message, for the log."""


class PullServer:
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
            middlewares=[self._log_outcome, self._json_errors, self._guard],
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
        response = await handler(request)
        status = response.status
        level = logging.WARNING if status >= 400 else logging.DEBUG
        if status < 400 and request.path == "/pull_weights":
            level = logging.INFO
        if log.isEnabledFor(level):
            what = request.get(PULL_DETAIL)
            target = f"{request.method} {request.path_qs}" + (f" ({what})" if what else "")
            reason = response.get(MESSAGE)
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
            return _reply(PullReply(False, f"{exc.status} {exc.reason}"), exc.status)
        except Exception as exc:  # a bug must still answer {success, message}
            log.exception("%s %s failed unexpectedly", request.method, request.path)
            return _reply(PullReply(False, f"unexpected {type(exc).__name__}: {exc}"), 500)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The request rules (:class:`RequestRules`), then the bearer token."""
        refusal = self.rules.refusal(request)
        if refusal is not None:
            return _reply(PullReply(False, refusal[1]), refusal[0])
        token = self.config.token
        if token is not None and request.path != "/healthz":
            header = request.headers.get("Authorization", "")
            given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
            # Headers are decoded with surrogateescape: this gives back the bytes sent, so a
            # non-UTF-8 header compares unequal instead of raising.
            sent = given.encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, token.encode("utf-8")):
                reply = PullReply(False, "missing or wrong bearer token (Authorization: Bearer)")
                return _reply(reply, 401)
        return await handler(request)

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pulls_running": len(self.busy)})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def state(self, request: web.Request) -> web.Response:
        path = request.query.get("local_checkpoint_dir")
        if not path:
            return _reply(PullReply(False, "pass ?local_checkpoint_dir=ABSOLUTE_PATH"))
        try:
            real = self.policy.local_dir(path)
        except (FormatError, PermissionError) as exc:
            return _refused(exc)
        local = LocalCheckpoint(real)
        busy = real in self.busy

        def read() -> CheckpointStatus:
            # The state reads wait for a flush still running after a pull's reply: off the
            # event loop, so /healthz and other dirs' requests answer meanwhile.
            state, pending = local.read_state(), local.read_pending()
            body = json.loads(pending.to_json()) if pending is not None else None
            version, stream = (state.version, state.stream_id) if state else (None, None)
            return CheckpointStatus(path, version, stream, body, busy)

        status = await asyncio.get_running_loop().run_in_executor(None, read)
        return web.json_response(dataclasses.asdict(status))

    async def pull_weights(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        try:
            body = PullRequest.from_json(await request.read())
            local_dir = self.policy.local_dir(body.local_checkpoint_dir)
            # The source check walks a local store: off the event loop, so /healthz answers.
            sources = [
                await loop.run_in_executor(None, self.policy.source, s) for s in body.sources
            ]
            for one in sources:
                self.policy.separate(local_dir, one)
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body exceeds {MAX_REQUEST_BYTES} bytes"
            return _reply(PullReply(False, message), 413)
        except (FormatError, PermissionError) as exc:
            return _refused(exc)
        target = body.target_version
        shown = f"v{target:06d}" if isinstance(target, int) else target
        request[PULL_DETAIL] = f"{local_dir} {shown} from {', '.join(sources)}"
        lock = self.locks.setdefault(local_dir, asyncio.Lock())
        async with lock:  # one pull per local dir at a time; the flock covers other processes
            self.busy.add(local_dir)
            try:
                pull = functools.partial(self._pull, local_dir, sources, body)
                reply = await loop.run_in_executor(self.executor, pull)
            finally:
                self.busy.discard(local_dir)
        return _reply(reply)

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
                # The engine reloads from the page cache (docs/engines.md, "Replying before
                # the flush"); the next pull of the dir waits for the flush and the state.
                flush_after_reply=True,
            )
        except Exception as exc:  # a bug must still answer {success, message}
            self.metrics.failed(local_dir)
            if isinstance(exc, (DeltastoreError, OSError)):
                return PullReply(False, f"{type(exc).__name__}: {exc}")
            log.exception("pull of %s failed unexpectedly", local_dir)
            return PullReply(False, f"unexpected {type(exc).__name__}: {exc}")
        self.metrics.pulled(local_dir, result)
        return PullReply(True, result.message)


def _refused(exc: FormatError | PermissionError) -> web.Response:
    """403 for a path outside the rules, 400 for a malformed one."""
    return _reply(PullReply(False, str(exc)), 403 if isinstance(exc, PermissionError) else 400)


def _reply(reply: PullReply, status: int | None = None) -> web.Response:
    status = status or (200 if reply.success else 400)
    response = web.json_response(dataclasses.asdict(reply), status=status)
    response[MESSAGE] = reply.message
    return response


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
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(config: ServerConfig, ready: Callable[[str], None] | None = None) -> None:
    asyncio.run(serve_async(config, ready))
