"""The version index: ``model.safetensors.index.json``.

Reference keys (``version``, ``base_version``, ``delta_encoding``, ``compression_format``,
``checksum_format``) are what reference readers use; deltastore adds its own keys (``stream_id``,
totals, ``commit_token``) that reference readers ignore. An index without ``delta_encoding`` is
an ordinary full checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from deltastore.errors import FormatError
from deltastore.format.names import check_shard_file_name, format_version, parse_version

REFERENCE_KEYS = (
    "version",
    "base_version",
    "delta_encoding",
    "compression_format",
    "checksum_format",
)
OWN_INT_KEYS = ("total_bytes", "changed_bytes", "wire_bytes", "tensor_count")
FORMAT_NAME = "deltastore/1"


@dataclass(frozen=True)
class VersionIndex:
    """The parsed index of one published version."""

    version: int
    weight_map: dict[str, str]
    """Tensor name → shard file name inside the version directory."""
    base_version: int | None = None  # None on a full version that records none
    encoding: str | None = None  # None: a full checkpoint
    compression: str | None = None
    checksum: str | None = None  # of the per-tensor digests in the shard metadata
    stream_id: str | None = None
    """Identity of the publisher's stream, fixed at seed; None for foreign publishers."""
    commit_token: str | None = None
    """Unique token of the writer that committed this index (lost-ack detection)."""
    totals: dict[str, int] = field(default_factory=dict)  # deltastore's OWN_INT_KEYS
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other metadata keys, kept verbatim."""

    @property
    def is_delta(self) -> bool:
        return self.encoding is not None

    @property
    def kind(self) -> str:
        return "delta" if self.is_delta else "full"

    def shards(self) -> dict[str, list[str]]:
        """Shard file → tensor names the index maps to it, both in sorted order."""
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in sorted(self.weight_map.items()):
            by_shard[shard].append(name)
        return dict(sorted(by_shard.items()))

    def to_json(self) -> bytes:
        """Serialise with the reference key spellings (6-digit version strings)."""
        return (json.dumps(self._body(), indent=2, sort_keys=False) + "\n").encode("utf-8")

    def content_digest(self) -> str:
        """SHA-256 (hex) of what a reader depends on, independent of the copy it was read from.

        Two stores hold the same version exactly when these are equal: lineage, encoding,
        compression, checksum algorithm, stream id, totals, weight map and every other
        metadata key (signatures included) count; the store-local commit token of the writer
        that committed this copy (each replica's own) and the JSON layout do not.
        """
        body = replace(self, commit_token=None)._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    def _body(self) -> dict[str, Any]:
        metadata: dict[str, Any] = dict(self.extra)
        metadata["version"] = format_version(self.version)
        base = None if self.base_version is None else format_version(self.base_version)
        keys = {  # in this order: it is the published bytes' key order
            "base_version": base,
            "delta_encoding": self.encoding,
            "compression_format": self.compression,
            "checksum_format": self.checksum,
            "format": metadata.get("format", FORMAT_NAME),
            "stream_id": self.stream_id,
            "commit_token": self.commit_token,
        }
        metadata.update((key, value) for key, value in keys.items() if value is not None)
        metadata.update(self.totals)
        return {"metadata": metadata, "weight_map": dict(sorted(self.weight_map.items()))}

    @classmethod
    def from_json(cls, data: bytes, *, version: int, source: str = "index") -> VersionIndex:
        """Parse and validate an index read from ``weight_v{version}``; :class:`FormatError`
        when malformed, of another version, or naming a shard that is not a plain file name."""
        metadata, weight_map = _parse_body(data, version=version, source=source)
        extra = dict(metadata)
        encoding, base_version = _pop_lineage(extra, version=version, source=source)
        if extra.get("format") == FORMAT_NAME:
            # to_json writes it back; keeping it in `extra` would make a round trip unequal.
            del extra["format"]
        compression = extra.pop("compression_format", None)
        checksum = extra.pop("checksum_format", None)
        stream_id = extra.pop("stream_id", None)
        commit_token = extra.pop("commit_token", None)
        totals: dict[str, int] = {}
        for key in OWN_INT_KEYS:
            value = extra.pop(key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                totals[key] = value
        return cls(
            version=version,
            weight_map=dict(weight_map),
            base_version=base_version,
            encoding=encoding,
            compression=compression if isinstance(compression, str) else None,
            checksum=checksum if isinstance(checksum, str) else None,
            stream_id=stream_id if isinstance(stream_id, str) else None,
            commit_token=commit_token if isinstance(commit_token, str) else None,
            totals=totals,
            extra=extra,
        )


def _parse_body(data: bytes, *, version: int, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's ``metadata`` and ``weight_map`` objects, checked for shape."""
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise FormatError(f"{source} is not a JSON object")
    metadata = body.get("metadata") or {}
    weight_map = body.get("weight_map")
    if not isinstance(metadata, dict):
        raise FormatError(f"{source}: 'metadata' is not an object")
    if not isinstance(weight_map, dict):
        raise FormatError(f"{source}: 'weight_map' is missing or not an object")
    for name in weight_map:
        if not isinstance(name, str) or not name:
            raise FormatError(f"{source}: weight_map has an invalid tensor name {name!r}")
    for target in set(weight_map.values()):
        check_shard_file_name(target, version=version)
    return metadata, weight_map


def _pop_lineage(
    extra: dict[str, Any], *, version: int, source: str
) -> tuple[str | None, int | None]:
    """Take the encoding and base version out of ``extra`` (the metadata), checked against
    the directory's ``version``: a delta carries both, and its base is older."""
    encoding = extra.pop("delta_encoding", None)
    declared = extra.pop("version", None)
    if declared is not None and parse_version(declared, what=f"{source} version") != version:
        raise FormatError(
            f"{source} declares version {declared!r} but lives in weight_v{version:06d}; "
            "the store is inconsistent, republish that version"
        )
    if encoding is not None and declared is None:
        raise FormatError(f"{source}: a delta index must carry its 'version'")
    base_raw = extra.pop("base_version", None)
    base_version = (
        parse_version(base_raw, what=f"{source} base_version") if base_raw is not None else None
    )
    if encoding is not None:
        if not isinstance(encoding, str):
            raise FormatError(f"{source}: delta_encoding {encoding!r} is not a string")
        if base_version is None:
            raise FormatError(f"{source}: a delta index must carry its 'base_version'")
        if base_version >= version:
            raise FormatError(
                f"{source}: delta weight_v{version:06d} claims base version "
                f"{base_version:06d}, which is not older"
            )
    return encoding, base_version


def check_shard_names(
    index: VersionIndex, shard: str, names_in_shard: set[str], *, source: str
) -> None:
    """Refuse a shard that holds other names than exactly those the index maps to it: a
    half-visible listing or a foreign file must not pass as a smaller update."""
    expected = {name for name, target in index.weight_map.items() if target == shard}
    if names_in_shard != expected:
        missing = sorted(expected - names_in_shard)[:5]
        unexpected = sorted(names_in_shard - expected)[:5]
        raise FormatError(
            f"{source}: shard {shard} of weight_v{index.version:06d} does not hold exactly the "
            f"tensors its index maps to it (missing {missing}, unexpected {unexpected}); "
            "the version is corrupt or was written by two writers"
        )
