"""Client of ``deltastore serve`` (or any reference ``/pull_weights`` endpoint), and the one
small JSON-over-HTTP call (:func:`call`) every other deltastore client uses (the engine sync).

:func:`pull_all` asks many hosts to pull one version concurrently and returns each host's typed
reply; an unreachable host or a reply that is not ``{success, message}`` becomes a failed
:class:`PullReply` saying so, never an exception that hides the other hosts' outcomes.
"""

from __future__ import annotations

import concurrent.futures as cf
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
from deltastore.pull.protocol import CheckpointStatus, PullReply, PullRequest


@dataclass(frozen=True)
class EndpointReply:
    """One host's answer to a pull request."""

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
        """The host's ``message`` (or why it could not be reached)."""
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


def _headers(token: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


@dataclass(frozen=True)
class HttpReply:
    """What one HTTP call to an engine or a ``deltastore serve`` answered."""

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
    http = urllib.request.Request(full, data=data, headers=_headers(token), method=method)
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
    """POST one pull request; never raises for a failed or unreachable host."""
    url = normalize_endpoint(endpoint)
    sent = json.loads(request.to_json())
    answer = call(url, "/pull_weights", sent, token=token, timeout_s=timeout_s)
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

    ``local_checkpoint_dir`` is one path for every host, or a mapping endpoint → path.
    Check ``all(r.success for r in replies)``; each failed reply's message names its host.
    """
    if not endpoints:
        raise ConfigError("pull_all needs at least one endpoint")

    def request_for(endpoint: str) -> PullRequest:
        if isinstance(local_checkpoint_dir, str):
            directory = local_checkpoint_dir
        else:
            try:
                directory = local_checkpoint_dir[endpoint]
            except KeyError:
                raise ConfigError(f"no local_checkpoint_dir given for {endpoint}") from None
        sources = source_dir if isinstance(source_dir, str) else tuple(source_dir)
        return PullRequest(directory, sources, target_version)

    requests = [request_for(e) for e in endpoints]
    with cf.ThreadPoolExecutor(max_parallel or len(endpoints)) as pool:
        futures = [
            pool.submit(pull_one, e, r, token=token, timeout_s=timeout_s)
            for e, r in zip(endpoints, requests)
        ]
        return [f.result() for f in futures]


def fetch_state(
    endpoint: str, local_checkpoint_dir: str, *, token: str | None = None, timeout_s: float = 30.0
) -> CheckpointStatus:
    """``GET /state`` of one host's local checkpoint.

    Raises :class:`StoreError` when the host is unreachable or refuses (401/403/400).
    """
    url = normalize_endpoint(endpoint)
    query = urllib.parse.urlencode({"local_checkpoint_dir": local_checkpoint_dir})
    http = urllib.request.Request(f"{url}/state?{query}", headers=_headers(token))
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            return CheckpointStatus.from_json(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            message = PullReply.from_json(body).message
        except FormatError:
            message = body.decode("utf-8", "replace")[:200]
        raise StoreError(f"{url}/state answered HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, http_client.HTTPException) as exc:
        raise StoreError(f"{url} is unreachable: {getattr(exc, 'reason', exc)!r}") from None


__all__ = [
    "EndpointReply",
    "HttpReply",
    "call",
    "fetch_state",
    "normalize_endpoint",
    "pull_all",
    "pull_one",
]
