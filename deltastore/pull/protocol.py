"""The ``/pull_weights`` wire types, shared by the server and every client.

One typed request and one typed reply, parsed strictly: a reply without ``success`` and
``message`` is a :class:`FormatError` naming what was received, never an "unknown error".
The request and reply are the reference engine endpoint's:
``POST /pull_weights {local_checkpoint_dir, source_dir, target_version}`` answered by
``{success, message}`` with HTTP 200 on success, 400 on failure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltastore.errors import FormatError
from deltastore.format.state import AppliedState, PendingTransition

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
    """``POST /pull_weights`` body."""

    local_checkpoint_dir: str
    source_dir: str | tuple[str, ...]
    """A local directory or a store URL (``s3://``, ``gs://``, ...), or several copies of one
    run's store, nearest first (each version is read from the first that has it)."""
    target_version: int | str
    """A version number, or ``"latest"``: the newest committed version when the pull runs."""

    @property
    def sources(self) -> tuple[str, ...]:
        """``source_dir`` as a tuple of one or more sources."""
        return (self.source_dir,) if isinstance(self.source_dir, str) else self.source_dir

    def to_json(self) -> bytes:
        source = self.source_dir if isinstance(self.source_dir, str) else list(self.source_dir)
        return json.dumps(
            {
                "local_checkpoint_dir": self.local_checkpoint_dir,
                "source_dir": source,
                "target_version": self.target_version,
            }
        ).encode()

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
"""The fields of a ``POST /pull_weights`` body, as the reference engine endpoint takes them."""

MAX_SOURCES = 8
"""Most stores one request may name in ``source_dir``."""


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
    """``{success, message}``: the reply of ``POST /pull_weights``."""

    success: bool
    message: str

    @property
    def http_status(self) -> int:
        return 200 if self.success else 400

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

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
    """``GET /state``: what a host's local checkpoint records."""

    local_checkpoint_dir: str
    version: int | None
    """The applied version; None when the state is missing (never pulled, or mid-transition)."""
    stream_id: str | None
    pending: dict[str, Any] | None
    """The interrupted or in-progress transition: ``from``, ``to``, ``versions``, streams."""
    busy: bool = False
    """True while this server runs a pull for that directory."""

    @classmethod
    def of(
        cls,
        directory: str,
        state: AppliedState | None,
        pending: PendingTransition | None,
        busy: bool = False,
    ) -> CheckpointStatus:
        pending_body = json.loads(pending.to_json()) if pending is not None else None
        return cls(
            directory,
            state.version if state is not None else None,
            state.stream_id if state is not None else None,
            pending_body,
            busy,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_checkpoint_dir": self.local_checkpoint_dir,
            "version": self.version,
            "stream_id": self.stream_id,
            "pending": self.pending,
            "busy": self.busy,
        }

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


__all__ = [
    "MAX_PATH_CHARS",
    "MAX_TARGET_VERSION",
    "CheckpointStatus",
    "PullReply",
    "PullRequest",
    "check_request_path",
]
