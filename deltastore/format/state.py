"""Engine-side state files in ``<local_checkpoint>/.weight_sync/``.

``state.json`` is the reference's ``{"version": "000007"}`` plus deltastore's own keys.
``pending.json`` records a transition in progress so a crash can be repaired.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import FormatError
from deltastore.format.names import format_version, parse_version


def _json_object(data: bytes) -> dict[str, Any]:
    body = json.loads(data.decode("utf-8"))
    if not isinstance(body, dict):
        raise ValueError("not an object")
    return body


def _dumps(body: dict[str, Any]) -> bytes:
    return (json.dumps(body) + "\n").encode()


@dataclass(frozen=True)
class AppliedState:
    """What a local checkpoint holds, as recorded in ``state.json``."""

    version: int
    stream_id: str | None = None
    """Stream of the applied version; None for version 0 (the base) or a foreign publisher."""
    source: str | None = None
    """Store URL the version came from (informational)."""
    files: dict[str, tuple[int, int]] | None = None
    """Weight file name → (size in bytes, mtime in ns) when the state was written; a pull that
    finds other values fully verifies the checkpoint. None: not recorded (a foreign writer)."""
    sources: dict[int, str] | None = None
    """Version → URL of the store the last pull read it from, when it read from several."""

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"version": format_version(self.version)}
        if self.stream_id is not None:
            body["stream_id"] = self.stream_id
        if self.source is not None:
            body["source"] = self.source
        if self.files is not None:
            body["files"] = {name: list(value) for name, value in sorted(self.files.items())}
        if self.sources is not None:
            body["sources"] = {format_version(v): url for v, url in sorted(self.sources.items())}
        return _dumps(body)

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "state.json") -> AppliedState:
        try:
            body = _json_object(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FormatError(
                f"{source} is unreadable ({exc}); the checkpoint will reseed"
            ) from None
        version = parse_version(body.get("version"), what=f"{source} version")
        stream = body.get("stream_id")
        src = body.get("source")
        return cls(
            version,
            stream if isinstance(stream, str) else None,
            src if isinstance(src, str) else None,
            _parse_files(body.get("files")),
            _parse_sources(body.get("sources")),
        )


def _parse_sources(value: object) -> dict[int, str] | None:
    """The ``sources`` record, or None when absent or malformed (it is informational)."""
    if not isinstance(value, dict):
        return None
    try:
        return {parse_version(k): v for k, v in value.items() if isinstance(v, str)}
    except (ValueError, FormatError):
        return None


def _parse_files(value: object) -> dict[str, tuple[int, int]] | None:
    """The ``files`` fingerprints, or None when absent or malformed (then a pull verifies)."""
    if not isinstance(value, dict):
        return None
    files: dict[str, tuple[int, int]] = {}
    for name, pair in value.items():
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        ):
            return None
        files[name] = (pair[0], pair[1])
    return files


@dataclass(frozen=True)
class PendingTransition:
    """A transition being made in place: from one applied version to another."""

    from_version: int | None
    to_version: int
    stream_id: str | None = None
    from_stream_id: str | None = None
    versions: list[int] = field(default_factory=list)
    """The versions being applied, in order."""

    def to_json(self) -> bytes:
        body = {
            "from": None if self.from_version is None else format_version(self.from_version),
            "to": format_version(self.to_version),
            "stream_id": self.stream_id,
            "from_stream_id": self.from_stream_id,
            "versions": [format_version(v) for v in self.versions],
        }
        return _dumps(body)

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "pending.json") -> PendingTransition:
        try:
            body = _json_object(data)
            return cls(
                None if body.get("from") is None else parse_version(body["from"]),
                parse_version(body.get("to")),
                body.get("stream_id"),
                body.get("from_stream_id"),
                [parse_version(v) for v in body.get("versions", [])],
            )
        except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
            raise FormatError(f"{source} is unreadable ({exc})") from None
