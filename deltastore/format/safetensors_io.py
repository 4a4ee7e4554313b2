"""Safetensors headers without the data: parse byte ranges, write files as a stream.

Only the 8-byte length prefix and the JSON header are handled here. Parsing gives each tensor's
absolute byte range in the file, so a reader can mmap or range-read one tensor without loading a
shard. The writer streams tensors into any binary file object (a local file, an fsspec upload)
and is dtype-blind: it takes the safetensors dtype string and raw bytes, so bf16 and float8 need
no framework dtype objects and no whole-file buffer.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from deltastore.errors import FormatError

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Upper bound on a header's JSON; larger ones are refused as hostile before reading them."""

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives inside a safetensors file."""

    name: str
    dtype: str
    """Safetensors dtype string, e.g. ``BF16``."""
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's first byte in the file."""
    end: int
    """Absolute byte offset one past its last byte."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: tensors in file order, the string metadata, and the data offset."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    """Absolute offset of the data section (8 + header length)."""
    data_length: int | None
    """Bytes of data the header accounts for."""


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json`` object hook: refuse an object that names a key twice (json keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the key named twice (a dict build is C-fast)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


def header_length(prefix: bytes, *, source: str = "safetensors file") -> int:
    """Decode and bound-check the 8-byte little-endian header length."""
    if len(prefix) < 8:
        raise FormatError(f"{source} is truncated: {len(prefix)} bytes, not even a header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length < 2 or length > MAX_HEADER_BYTES:
        raise FormatError(
            f"{source} declares a {length}-byte header (allowed 2..{MAX_HEADER_BYTES}); "
            "it is corrupt or not a safetensors file"
        )
    return length


def _tensor_entry(name: str, spec: Any, data_start: int, source: str) -> TensorEntry:
    """One header entry, checked (dtype known, shape and offsets sane, size consistent). Exact
    ``type`` checks: a header of thousands of small tensors is parsed on every pull."""
    if type(spec) is not dict:
        raise FormatError(f"{source}: entry {name!r} is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if type(dtype) is not str or (expected := DTYPE_SIZES.get(dtype)) is None:
        raise FormatError(f"{source}: tensor {name!r} has unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise FormatError(f"{source}: tensor {name!r} has invalid shape {shape!r}")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise FormatError(f"{source}: tensor {name!r} has invalid shape {shape!r}")
        expected *= dim
    if type(offsets) is not list or len(offsets) != 2:
        raise FormatError(f"{source}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        raise FormatError(f"{source}: tensor {name!r} has invalid data_offsets {offsets!r}")
    if end - begin != expected:
        raise FormatError(
            f"{source}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs "
            f"{expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def parse_header(
    header_json: bytes, *, file_size: int | None = None, source: str = "safetensors file"
) -> SafetensorsHeader:
    """Parse the JSON header (without its 8-byte prefix) into absolute byte ranges;
    :class:`FormatError` on anything malformed, or past ``file_size`` when known (a truncated
    shard is reported here rather than as a short read later)."""
    try:
        raw = json.loads(header_json.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{source} has an unreadable header: {exc}") from None
    except _DuplicateKey as exc:
        raise FormatError(f"{source}: header names {exc.key!r} twice") from None
    if not isinstance(raw, dict):
        raise FormatError(f"{source} header is not a JSON object")
    data_start = 8 + len(header_json)
    metadata_raw = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise FormatError(f"{source} __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    data_end = 0
    for name, spec in raw.items():
        entry = _tensor_entry(name, spec, data_start, source)
        tensors[name] = entry
        data_end = max(data_end, entry.end - data_start)
    # Entries must not share bytes: an in-place write to one would change the other after it
    # was verified (safetensors itself refuses such files).
    ordered = sorted(tensors.values(), key=lambda t: (t.start, t.end))
    for before, after in itertools.pairwise(ordered):
        if after.start < before.end:
            raise FormatError(
                f"{source}: tensors {before.name!r} and {after.name!r} overlap; the file is "
                "corrupt or hostile"
            )
    if file_size is not None and data_start + data_end > file_size:
        raise FormatError(
            f"{source} is truncated: its header needs {data_start + data_end} bytes, "
            f"the file has {file_size}"
        )
    return SafetensorsHeader(tensors, dict(metadata_raw), data_start, data_end)


def read_header(
    fileobj: _Readable, *, file_size: int | None = None, source: str = "safetensors file"
) -> SafetensorsHeader:
    """Read and parse the header from the start of an open binary file."""
    length = header_length(fileobj.read(8), source=source)
    header_json = fileobj.read(length)
    if len(header_json) != length:
        raise FormatError(f"{source} is truncated inside its {length}-byte header")
    return parse_header(header_json, file_size=file_size, source=source)


def read_header_file(path: str) -> SafetensorsHeader:
    """Parse the header of a local safetensors file."""
    with open(path, "rb") as fh:
        return read_header(fh, file_size=os.fstat(fh.fileno()).st_size, source=path)


@dataclass(frozen=True)
class TensorLayout:
    """One tensor to write: name, safetensors dtype string, shape; its bytes come separately."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_SIZES:
            raise FormatError(f"tensor {self.name!r}: unknown safetensors dtype {self.dtype!r}")
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def build_header(tensors: Iterable[TensorLayout], metadata: Mapping[str, str]) -> bytes:
    """The length-prefixed header for ``tensors`` laid out back to back in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for tensor in tensors:
        size = tensor.nbytes
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces to 8 bytes so the data section is aligned, as safetensors does.
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_safetensors(
    out: BinaryIO,
    tensors: Sequence[tuple[TensorLayout, bytes | memoryview]],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Stream a safetensors file into ``out``; returns the number of bytes written."""
    for layout, data in tensors:
        if len(memoryview(data).cast("B")) != layout.nbytes:
            raise FormatError(
                f"tensor {layout.name!r}: {len(memoryview(data).cast('B'))} bytes do not fit "
                f"{layout.dtype}{list(layout.shape)}"
            )
    head = build_header([layout for layout, _ in tensors], metadata or {})
    out.write(head)
    for _, data in tensors:
        out.write(memoryview(data).cast("B"))
    return len(head) + sum(layout.nbytes for layout, _ in tensors)
