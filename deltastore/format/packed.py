"""Packed delta shards: many small payloads under one safetensors entry.

A reference encoding's delta shard keeps one ``U8`` entry and one metadata digest per changed
tensor: about 140 bytes of JSON each, as much as a sparse payload of a 64 KB tensor. Shards of
deltastore's own encodings are packed instead: one entry, :data:`PACK_ENTRY`, holds every
payload frame back to back, and :data:`PACK_KEY` a table (names, frame lengths, digests) as
base64 of one zstd frame of JSON, about 30 bytes a tensor. :func:`unpack_header` turns a packed
header back into a plain shard's entries and digests, so every reader sees one shape.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Sequence

import zstandard

from deltastore.errors import FormatError
from deltastore.format.safetensors_io import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorEntry,
    TensorLayout,
    build_header,
)

PACK_KEY = "deltastore.pack"
"""Metadata key of a packed shard's table."""
PACK_ENTRY = "deltastore.payloads"
"""The one entry of a packed shard: every payload frame, in table order."""
PACK_FORMAT = 1
"""Version of the table layout; a reader refuses any other."""
_TABLE_LEVEL = 3
"""zstd level of the table: names share long prefixes, and the table is small."""


def build_packed_header(
    names: Sequence[str], lengths: Sequence[int], digests: Sequence[str]
) -> bytes:
    """The length-prefixed header of a packed shard whose payload frames (``lengths[i]`` bytes
    for ``names[i]``) follow it back to back in this order."""
    table = {
        "format": PACK_FORMAT,
        "names": list(names),
        "lengths": list(lengths),
        "digests": "".join(digests),
    }
    raw = json.dumps(table, separators=(",", ":")).encode("utf-8")
    frame = zstandard.ZstdCompressor(level=_TABLE_LEVEL, write_content_size=True).compress(raw)
    metadata = {PACK_KEY: base64.b64encode(frame).decode("ascii")}
    return build_header([TensorLayout(PACK_ENTRY, "U8", (sum(lengths),))], metadata)


def unpack_header(header: SafetensorsHeader, *, source: str) -> SafetensorsHeader:
    """``header`` as a plain delta shard's: one ``U8`` entry and one digest per tensor (one
    without :data:`PACK_KEY` as it is); :class:`FormatError` for a table that is unreadable or
    does not cover the packed entry exactly."""
    packed = header.metadata.get(PACK_KEY)
    if packed is None:
        return header
    entry = header.tensors.get(PACK_ENTRY)
    if entry is None or len(header.tensors) != 1 or entry.dtype != "U8" or len(entry.shape) != 1:
        raise FormatError(
            f"{source}: a packed shard must hold exactly one 1-D U8 entry {PACK_ENTRY!r}; the "
            "shard is corrupt or was not written by deltastore"
        )
    names, lengths, digests = _read_table(packed, source)
    tensors: dict[str, TensorEntry] = {}
    metadata = {k: v for k, v in header.metadata.items() if k != PACK_KEY}
    start = entry.start
    for name, length, digest in zip(names, lengths, digests, strict=True):
        if name in tensors or name in metadata or name == PACK_ENTRY:
            raise FormatError(f"{source}: the pack table names {name!r} twice")
        tensors[name] = TensorEntry(name, "U8", (length,), start, start + length)
        metadata[name] = digest
        start += length
    if start != entry.end:
        raise FormatError(
            f"{source}: the pack table accounts for {start - entry.start} bytes, the packed "
            f"entry holds {entry.nbytes}; the shard is corrupt"
        )
    return SafetensorsHeader(tensors, metadata, header.data_start, header.data_length)


def _read_table(packed: str, source: str) -> tuple[list[str], list[int], list[str]]:
    """Decode and check a table: names, frame lengths, digests (equal-width hex)."""
    try:
        frame = base64.b64decode(packed.encode("ascii"), validate=True)
        # The declared size is checked before anything is allocated (a hostile table could
        # declare gigabytes); a table is never larger than a header may be.
        size = zstandard.frame_content_size(frame)
        if not 0 <= size <= MAX_HEADER_BYTES:
            raise FormatError(f"{source}: the pack table declares {size} bytes")
        table = json.loads(zstandard.ZstdDecompressor().decompress(frame, max_output_size=size))
    except (
        UnicodeError,
        binascii.Error,
        zstandard.ZstdError,
        json.JSONDecodeError,
        RecursionError,
        struct.error,
    ) as exc:
        raise FormatError(f"{source}: the pack table is unreadable ({exc})") from None
    found = table.get("format") if isinstance(table, dict) else None
    if found != PACK_FORMAT:
        raise FormatError(
            f"{source}: pack table format {found!r} is not {PACK_FORMAT}; the shard is corrupt "
            "or was written by a newer deltastore (upgrade to read it)"
        )
    names, lengths, digests = table.get("names"), table.get("lengths"), table.get("digests")
    if (
        not isinstance(names, list)
        or not isinstance(lengths, list)
        or not isinstance(digests, str)
        or len(names) != len(lengths)
        or not all(isinstance(n, str) for n in names)
        or not all(type(n) is int and n >= 0 for n in lengths)
    ):
        raise FormatError(f"{source}: the pack table's names and lengths do not match")
    width = len(digests) // len(names) if names else 0
    if width * len(names) != len(digests):
        raise FormatError(f"{source}: the pack table's digests do not split into one per tensor")
    return names, lengths, [digests[i * width : (i + 1) * width] for i in range(len(names))]
