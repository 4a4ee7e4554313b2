"""The ``/pull_weights`` wire types, the client of ``deltastore serve`` (or any reference
endpoint), and the one JSON-over-HTTP call (:func:`call`) the engine sync uses too.

``POST /pull_weights {local_checkpoint_dir, source_dir, target_version}`` is answered by
``{success, message}`` (HTTP 200, or 400 on failure), parsed strictly: anything else is a
:class:`FormatError` naming what was received. :func:`pull_all` asks many hosts at once; an
unreachable host or a malformed reply becomes a failed :class:`PullReply` saying so, never an
exception that hides the other hosts' outcomes.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import http.client as http_client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import ConfigError, FormatError, StoreError

MAX_PATH_CHARS = 4096
"""Longest path or URL a request may carry (PATH_MAX on Linux)."""

MAX_TARGET_VERSION = 10**18 - 1
"""Largest target version a request may ask for: 18 digits, so every engine fits it in int64."""


def check_request_path(value: str, key: str) -> str:
    """Refuse a request path with a NUL or control character, or longer than
    :data:`MAX_PATH_CHARS` (:class:`FormatError`, a 400), before any file call sees it."""
    if len(value) > MAX_PATH_CHARS:
        raise FormatError(f"{key} is {len(value)} characters long (at most {MAX_PATH_CHARS})")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise FormatError(f"{key} {value[:200]!r} contains a NUL or control character")
    return value


def _load_object(data: bytes | str | Mapping[str, Any], what: str) -> Mapping[str, Any]:
    if isinstance(data, Mapping):
        return data
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{what} is not JSON ({exc}): {str(data)[:200]!r}") from None
    if not isinstance(body, dict):
        raise FormatError(f"{what} is not a JSON object: {str(data)[:200]!r}")
    return body


@dataclass(frozen=True)
class PullRequest:
    local_checkpoint_dir: str
    source_dir: str | tuple[str, ...]
    """A local directory or a store URL (``s3://``, ``gs://``, ...), or several copies of one
    run's store, nearest first (each version is read from the first that has it)."""
    target_version: int | str
    """A version number, or ``"latest"``: the newest committed version when the pull runs."""

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source_dir,) if isinstance(self.source_dir, str) else self.source_dir

    def to_dict(self) -> dict[str, Any]:
        source = self.source_dir if isinstance(self.source_dir, str) else list(self.source_dir)
        return {**dataclasses.asdict(self), "source_dir": source}

    @classmethod
    def from_json(cls, data: bytes | str | Mapping[str, Any]) -> PullRequest:
        """Parse a request; :class:`FormatError` names the missing or mistyped field."""
        body = _load_object(data, "the request")
        unknown = sorted(set(body) - set(REQUEST_FIELDS))
        if unknown:
            # A misspelt field would otherwise be dropped silently and its default used.
            raise FormatError(
                f"the request has unknown field {unknown[0]!r}; /pull_weights takes "
                + ", ".join(REQUEST_FIELDS)
            )
        local = body.get("local_checkpoint_dir")
        if not isinstance(local, str) or not local:
            raise FormatError("the request needs 'local_checkpoint_dir' as a non-empty string")
        return cls(
            check_request_path(local, "local_checkpoint_dir"),
            _source_dir(body.get("source_dir")),
            _target_version(body.get("target_version")),
        )


REQUEST_FIELDS = ("local_checkpoint_dir", "source_dir", "target_version")

MAX_SOURCES = 8  # stores one request may name in ``source_dir``


def _source_dir(raw: object) -> str | tuple[str, ...]:
    """A non-empty string, or a list of 1..MAX_SOURCES of them (each a checked path/URL)."""
    if isinstance(raw, str) and raw:
        return check_request_path(raw, "source_dir")
    if (
        isinstance(raw, list)
        and 0 < len(raw) <= MAX_SOURCES
        and all(isinstance(item, str) and item for item in raw)
    ):
        return tuple(check_request_path(item, "source_dir") for item in raw)
    raise FormatError(
        "the request needs 'source_dir' as a non-empty string or a list of 1 to "
        f"{MAX_SOURCES} non-empty strings (stores nearest first)"
    )


def _target_version(raw: object) -> int | str:
    """An integer in 0..MAX_TARGET_VERSION, an all-digit string of at most 18 digits, or
    ``"latest"`` (as the CLI and :func:`~deltastore.pull_weights` take it)."""
    if raw == "latest":
        return "latest"
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 18:
        raw = int(raw)
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= MAX_TARGET_VERSION:
        shown = repr(raw) if not isinstance(raw, (str, int)) or len(str(raw)) <= 40 else "..."
        raise FormatError(
            f"the request needs 'target_version' as an integer in 0..{MAX_TARGET_VERSION} "
            f'or "latest", got {shown}'
        )
    return raw


@dataclass(frozen=True)
class PullReply:
    success: bool
    message: str

    @classmethod
    def from_json(cls, data: bytes | str | Mapping[str, Any]) -> PullReply:
        """Parse a reply; :class:`FormatError` when ``success``/``message`` are not there."""
        body = _load_object(data, "the reply")
        success, message = body.get("success"), body.get("message")
        if not isinstance(success, bool) or not isinstance(message, str):
            raise FormatError(
                "the reply lacks a boolean 'success' and a string 'message': "
                f"{json.dumps(dict(body))[:200]}"
            )
        return cls(success, message)


@dataclass(frozen=True)
class CheckpointStatus:
    """``GET /state``."""

    local_checkpoint_dir: str
    version: int | None
    """The applied version; None when the state is missing (never pulled, or mid-transition)."""
    stream_id: str | None
    pending: dict[str, Any] | None
    """The interrupted or in-progress transition: ``from``, ``to``, ``versions``, streams."""
    busy: bool = False
    """True while this server runs a pull for that directory."""

    @classmethod
    def from_json(cls, data: bytes | str | Mapping[str, Any]) -> CheckpointStatus:
        body = _load_object(data, "the state reply")
        directory, version = body.get("local_checkpoint_dir"), body.get("version")
        if not isinstance(directory, str) or not (version is None or isinstance(version, int)):
            raise FormatError(f"not a state reply: {json.dumps(dict(body))[:200]}")
        stream, pending = body.get("stream_id"), body.get("pending")
        return cls(
            directory,
            version,
            stream if isinstance(stream, str) else None,
            pending if isinstance(pending, dict) else None,
            bool(body.get("busy", False)),
        )


@dataclass(frozen=True)
class EndpointReply:
    endpoint: str
    reply: PullReply
    status: int | None
    """HTTP status; None when the endpoint could not be reached."""
    seconds: float

    @property
    def success(self) -> bool:
        return self.reply.success

    @property
    def message(self) -> str:
        return self.reply.message

    def describe(self) -> str:
        status = self.status if self.status is not None else "unreachable"
        return f"{self.endpoint} [{status}]: {self.reply.message}"


def normalize_endpoint(endpoint: str) -> str:
    """``host:port`` → ``http://host:port`` (no trailing slash)."""
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint:
        raise ConfigError("an endpoint is empty; pass http://HOST:PORT")
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint


@dataclass(frozen=True)
class HttpReply:
    url: str
    """The URL called (without the query)."""
    status: int | None
    """HTTP status; None when the endpoint could not be reached."""
    body: bytes
    """The reply's body; for an unreachable endpoint, why it could not be reached."""
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def json(self) -> Any:
        """The body parsed as JSON; None when it is not JSON."""
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None

    def message(self) -> str:
        """A short reason: the JSON reply's ``message`` or ``error`` (vLLM's
        ``{"error": {"message": ...}}`` too), else the start of the body."""
        body = self.json()
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return str(error["message"])
            for key in ("message", "error", "detail"):
                if isinstance(body.get(key), str):
                    return str(body[key])
        return self.body.decode("utf-8", "replace").strip()[:300]

    def describe(self) -> str:
        status = self.status if self.status is not None else "unreachable"
        return f"{self.url} [{status}]: {self.message()}"


def call(
    endpoint: str,
    path: str,
    body: Mapping[str, Any] | None = None,
    *,
    method: str = "POST",
    query: Mapping[str, str] | None = None,
    token: str | None = None,
    timeout_s: float = 600.0,
) -> HttpReply:
    """One JSON call (``body`` sent as JSON when given); never raises for an HTTP error or an
    unreachable host: the reply says so."""
    url = f"{normalize_endpoint(endpoint)}{path}"
    full = f"{url}?{urllib.parse.urlencode(dict(query))}" if query else url
    data = json.dumps(dict(body)).encode() if body is not None else None
    started = time.perf_counter()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    http = urllib.request.Request(full, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        try:
            status, raw = exc.code, exc.read()
        except (http_client.HTTPException, OSError) as cut:
            status, raw = exc.code, f"(reply cut short: {cut!r})".encode()
    except (urllib.error.URLError, OSError, http_client.HTTPException) as exc:
        # HTTPException: a peer that does not speak HTTP or hangs up mid-reply.
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, http_client.HTTPException):
            reason = f"no valid HTTP reply ({exc!r})"
        message = f"{url} is unreachable: {reason}"
        return HttpReply(url, None, message.encode(), time.perf_counter() - started)
    return HttpReply(url, status, raw, time.perf_counter() - started)


def pull_one(
    endpoint: str, request: PullRequest, *, token: str | None = None, timeout_s: float = 3600.0
) -> EndpointReply:
    """Never raises for a failed or unreachable host."""
    url = normalize_endpoint(endpoint)
    answer = call(url, "/pull_weights", request.to_dict(), token=token, timeout_s=timeout_s)
    status, body = answer.status, answer.body
    if status is None:
        return EndpointReply(url, PullReply(False, body.decode()), None, answer.seconds)
    try:
        reply = PullReply.from_json(body)
    except FormatError as exc:
        reply = PullReply(False, f"HTTP {status} from {url}: {exc}")
    if reply.success and status != 200:
        reply = PullReply(False, f"HTTP {status} from {url} with success=true: {reply.message}")
    return EndpointReply(url, reply, status, answer.seconds)


def pull_all(
    endpoints: Sequence[str],
    target_version: int,
    *,
    local_checkpoint_dir: str | Mapping[str, str],
    source_dir: str | Sequence[str],
    token: str | None = None,
    timeout_s: float = 3600.0,
    max_parallel: int | None = None,
) -> list[EndpointReply]:
    """Ask every endpoint to pull ``target_version`` concurrently; replies in endpoint order.
    ``local_checkpoint_dir`` is one path for every host, or a mapping endpoint → path."""
    if not endpoints:
        raise ConfigError("pull_all needs at least one endpoint")
    dirs = local_checkpoint_dir
    if isinstance(dirs, str):
        dirs = dict.fromkeys(endpoints, dirs)
    for endpoint in endpoints:
        if endpoint not in dirs:
            raise ConfigError(f"no local_checkpoint_dir given for {endpoint}")
    sources = source_dir if isinstance(source_dir, str) else tuple(source_dir)
    requests = [PullRequest(dirs[e], sources, target_version) for e in endpoints]
    ask = functools.partial(pull_one, token=token, timeout_s=timeout_s)
    with cf.ThreadPoolExecutor(max_parallel or len(endpoints)) as pool:
        return list(pool.map(ask, endpoints, requests))


def fetch_state(
    endpoint: str, local_checkpoint_dir: str, *, token: str | None = None, timeout_s: float = 30.0
) -> CheckpointStatus:
    """``GET /state`` of one host's local checkpoint; :class:`StoreError` when the host is
    unreachable or refuses (401/403/400)."""
    query = {"local_checkpoint_dir": local_checkpoint_dir}
    answer = call(endpoint, "/state", method="GET", query=query, token=token, timeout_s=timeout_s)
    if answer.status is None:
        raise StoreError(answer.body.decode())
    if not answer.ok:
        raise StoreError(f"{answer.url} answered HTTP {answer.status}: {answer.message()}")
    return CheckpointStatus.from_json(answer.body)
