"""The trainer's snapshot: the last published state of every tensor, loaded on first use from
where it can be read back (all at ``seed()`` in a single process), and on resume its rebuild
from the chain's indexes and shard headers (a :class:`Lineage` of overlays on the base); the
checks of the tensors a trainer passes against the base.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deltastore.codecs import (
    ByteArray,
    check_compression,
    get_checksum,
    get_encoding,
)
from deltastore.errors import ConfigError, FormatError, IntegrityError, PublishError, StreamError
from deltastore.format import PayloadRef
from deltastore.format.checkpoint import checkpoint_files, read_file_range
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.safetensors_io import read_header_file
from deltastore.progress import ProgressMeter
from deltastore.publish.device import host_bytes, not_a_tensor
from deltastore.publish.spool import apply_frame
from deltastore.pull.result import run_pool
from deltastore.storage import VersionStore
from deltastore.storage.chain import walk_chain

_READ_CHUNK = 64 * 1024**2


@dataclass
class SnapshotTensor:
    """One tensor's published state: dtype string, shape and raw bytes (1-D uint8)."""

    dtype: str
    shape: tuple[int, ...]
    data: ByteArray


@dataclass(frozen=True)
class TensorSource:
    """How to read one tensor's bytes back: a starting range (``offset`` in ``file``, a base
    checkpoint file, or in ``shard`` of ``full_version`` in the store), then the deltas to
    apply, then the digest the result must have (None: trusted, e.g. the base)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    file: str | None = None
    full_version: int | None = None
    shard: str | None = None
    deltas: tuple[PayloadRef, ...] = field(default_factory=tuple)
    checksum: str | None = None
    digest: str | None = None

    def describe(self) -> str:
        start = self.file if self.file is not None else f"weight_v{self.full_version:06d}"
        chain = "".join(f" + v{d.version:06d}" for d in self.deltas)
        return f"{start}{chain}"


class Snapshot(Mapping[str, SnapshotTensor]):
    """Name → :class:`SnapshotTensor` in the base checkpoint's order, loaded on first access
    (thread-safe). ``store`` is needed only for sources that point into a store."""

    __eq__ = object.__eq__  # type: ignore[assignment]  # identity, never a load of every tensor
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __init__(self, sources: dict[str, TensorSource], store: VersionStore | None = None) -> None:
        self.sources = sources
        self.store = store
        self._loaded: dict[str, ByteArray] = {}
        self._lock = threading.Lock()

    @classmethod
    def describe_checkpoint(cls, directory: str) -> dict[str, TensorSource]:
        """Sources for every tensor of a safetensors checkpoint directory (headers only)."""
        sources: dict[str, TensorSource] = {}
        for path in checkpoint_files(directory):
            header = read_header_file(path)
            for name, entry in header.tensors.items():
                if name in sources:
                    raise ConfigError(f"tensor {name!r} appears twice in checkpoint {directory}")
                sources[name] = TensorSource(
                    entry.dtype, entry.shape, entry.nbytes, entry.start, file=path
                )
        return sources

    @classmethod
    def from_checkpoint(cls, directory: str) -> Snapshot:
        """The tensors of a safetensors checkpoint directory, read now (one read per file)."""
        snapshot = cls(cls.describe_checkpoint(directory))
        for path in checkpoint_files(directory):
            header = read_header_file(path)
            length = header.data_length or 0
            buffer = read_file_range(path, header.data_start, length, what="its tensor data")
            for name, entry in header.tensors.items():
                lo, hi = entry.start - header.data_start, entry.end - header.data_start
                snapshot._loaded[name] = buffer[lo:hi]
        return snapshot

    def __contains__(self, name: object) -> bool:
        return name in self.sources

    def __getitem__(self, name: str) -> SnapshotTensor:
        source = self.sources[name]
        return SnapshotTensor(source.dtype, source.shape, self.load(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def tensors(self) -> Mapping[str, SnapshotTensor]:
        """Every tensor by name; accessing one loads its bytes."""
        return self

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources.values())

    @property
    def loaded_bytes(self) -> int:
        with self._lock:
            return sum(int(a.size) for a in self._loaded.values())

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def load(self, name: str) -> ByteArray:
        """The tensor's bytes, read (and kept) on first access."""
        with self._lock:
            data = self._loaded.get(name)
        if data is not None:
            return data
        data = self.read(name)
        with self._lock:
            return self._loaded.setdefault(name, data)

    def peek(self, name: str) -> ByteArray:
        """The tensor's bytes without keeping them (loaded ones are returned as they are)."""
        with self._lock:
            data = self._loaded.get(name)
        return data if data is not None else self.read(name)

    def evict(self, name: str) -> None:
        """Forget a tensor's bytes (its source describes its current state)."""
        with self._lock:
            self._loaded.pop(name, None)

    def set_source(self, name: str, source: TensorSource, *, keep_loaded: bool = False) -> None:
        """Replace where a tensor is read from; ``keep_loaded``: it describes the same bytes."""
        with self._lock:
            self.sources[name] = source
            if not keep_loaded:
                self._loaded.pop(name, None)

    def load_all(self, workers: int = 4, meter: ProgressMeter | None = None) -> None:
        """Load (and check) every tensor now."""

        def load(name: str) -> None:
            self.load(name)
            if meter is not None:
                meter.advance(self.sources[name].nbytes)

        run_pool(list(self.sources), load, workers, name="deltastore-load")

    def read(self, name: str) -> ByteArray:
        """Read a tensor from its source and apply its deltas; :class:`IntegrityError` when the
        result does not match the recorded digest."""
        source = self.sources[name]
        if source.file is not None:
            data = read_file_range(
                source.file, source.offset, source.nbytes, what=f"tensor {name!r}"
            )
        else:
            data = np.empty(source.nbytes, dtype=np.uint8)
            store = self._need_store(name)
            assert source.full_version is not None and source.shard is not None
            for lo in range(0, source.nbytes, _READ_CHUNK):
                hi = min(source.nbytes, lo + _READ_CHUNK)
                chunk = store.read_range(
                    source.full_version, source.shard, source.offset + lo, source.offset + hi
                )
                data[lo:hi] = np.frombuffer(chunk, dtype=np.uint8)
        for ref in source.deltas:
            frame = self._need_store(name).read_range(ref.version, ref.shard, ref.start, ref.end)
            where = f" in weight_v{ref.version:06d}/{ref.shard}"
            apply_frame(get_encoding(ref.encoding), name, data, frame, where)
        if source.digest is not None:
            checksum = get_checksum(source.checksum or "xxh3-128")
            actual = checksum.hexdigest(data)
            if actual != source.digest:
                raise IntegrityError(
                    f"tensor {name!r} rebuilt from {source.describe()} has {checksum.name} "
                    f"{actual}, the store records {source.digest}; the store or the base "
                    "checkpoint does not match this stream"
                )
        return data

    def _need_store(self, name: str) -> VersionStore:
        if self.store is None:
            raise PublishError(f"tensor {name!r} is read from a store but the snapshot has none")
        return self.store


_TORCH_DTYPES: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
_NUMPY_DTYPES: dict[str, str] = {
    name: code
    for name, code in _TORCH_DTYPES.items()
    if not name.startswith(("bfloat", "float8"))  # torch dtypes numpy has no name for
}


_DTYPE_NAMES: dict[Any, str | None] = {}  # by torch dtype, filled on first sight (no format)


def safetensors_dtype_of(tensor: Any) -> str | None:
    """The safetensors dtype string of a torch tensor or numpy array, if it has one."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return None
    if isinstance(tensor, np.ndarray):
        return _NUMPY_DTYPES.get(tensor.dtype.name)
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = _TORCH_DTYPES.get(str(dtype).removeprefix("torch."))
        return name
    except TypeError:  # an unhashable dtype-like attribute: no safetensors dtype
        return None


def nbytes_of(name: str, tensor: Any) -> int:
    """Byte size of a torch tensor or numpy array, without touching its data."""
    if isinstance(tensor, np.ndarray):
        return int(tensor.nbytes)
    numel = getattr(tensor, "numel", None)
    element_size = getattr(tensor, "element_size", None)
    if callable(numel) and callable(element_size):
        return int(numel()) * int(element_size())
    raise not_a_tensor(name, tensor)


tensor_bytes = host_bytes


def check_layout(name: str, tensor: Any, nbytes: int, base: TensorSource) -> None:
    """Refuse a tensor whose dtype, shape or byte size differs from the base's; the dtype first
    (the commonest mistake, fp32 weights on a bf16 checkpoint, changes the size too)."""
    dtype = safetensors_dtype_of(tensor)
    # Raw uint8 byte arrays are accepted for any dtype: they are the dtype-blind path.
    typed = dtype is not None and dtype != "U8"
    if typed and dtype != base.dtype:
        torch_name = next((t for t, st in _TORCH_DTYPES.items() if st == base.dtype), None)
        cast = f" (`tensor.to(torch.{torch_name})`)" if torch_name else ""
        raise PublishError(
            f"tensor {name!r} is {dtype}, the base stores it as {base.dtype}; cast it first{cast}"
        )
    # torch.Size is a tuple: compared as it is, converted only for the message.
    shape = getattr(tensor, "shape", ())
    if typed and shape != base.shape:
        raise PublishError(
            f"tensor {name!r} has shape {list(shape)}, the base has {list(base.shape)}"
        )
    if nbytes != base.nbytes:
        raise PublishError(
            f"tensor {name!r} has {nbytes} bytes, the base has {base.nbytes} "
            f"({base.dtype}{list(base.shape)}); a delta needs equal sizes"
        )


@dataclass(frozen=True)
class Overlay:
    """What a chain changes about one tensor: a full-version start and/or deltas, and the
    digest of the result. It is relative to the base, so each rank lays it on its own copy."""

    full_version: int | None = None
    shard: str | None = None
    offset: int = 0
    deltas: tuple[PayloadRef, ...] = ()
    checksum: str | None = None
    digest: str | None = None

    def on(self, base: TensorSource) -> TensorSource:
        """``base`` (the tensor in the base checkpoint) with this overlay laid on it."""
        source = replace(base, deltas=self.deltas, checksum=self.checksum, digest=self.digest)
        if self.full_version is None:
            return source
        return replace(
            source, file=None, full_version=self.full_version, shard=self.shard, offset=self.offset
        )


@dataclass(frozen=True)
class Lineage:
    """The state of ``version`` of a stream, as overlays on the base checkpoint."""

    version: int
    stream_id: str | None
    overlays: dict[str, Overlay] = field(default_factory=dict)
    deltas: int = 0  # deltas since the chain's full start (or the base) ...
    wire_bytes: int = 0  # ... and their wire bytes (for the anchor rule)


def _check_layout(name: str, nbytes: int, sources: dict[str, TensorSource], where: str) -> None:
    base = sources.get(name)
    if base is None:
        raise StreamError(
            f"{where} holds tensor {name!r}, which the base checkpoint lacks; the stream was "
            "built on another base (pass the engines' model path as base_checkpoint)"
        )
    if nbytes != base.nbytes:
        raise StreamError(
            f"{where} holds tensor {name!r} with {nbytes} bytes, the base has {base.nbytes}; "
            "the stream was built on another base"
        )


def rebuild_lineage(
    store: VersionStore,
    target: int,
    sources: dict[str, TensorSource],
    names: Collection[str] | None = None,
) -> Lineage:
    """Overlays that turn the base's ``sources`` into the state of ``target`` (of ``names``
    only: then only their shards' headers are read). Raises :class:`StreamError` when the
    store's tensors do not fit the base, :class:`FormatError` for a corrupt version."""
    start, deltas = walk_chain(store, target)
    stream = deltas[-1].stream_id if deltas else (start.stream_id if start else None)
    overlays: dict[str, Overlay] = {}
    wanted = None if names is None else set(names)
    if start is not None:
        _overlay(store, start, sources, wanted, overlays, full=True)
    for delta in deltas:
        _overlay(store, delta, sources, wanted, overlays, full=False)
    return Lineage(
        version=target,
        stream_id=stream,
        overlays=overlays,
        deltas=len(deltas),
        wire_bytes=sum(int(delta.totals.get("wire_bytes", 0)) for delta in deltas),
    )


def _overlay(
    store: VersionStore,
    index: VersionIndex,
    sources: dict[str, TensorSource],
    wanted: set[str] | None,
    overlays: dict[str, Overlay],
    *,
    full: bool,
) -> None:
    """Lay one version of the chain on the wanted tensors' overlays (all when ``wanted`` is
    None): a full version is their new start, a delta appends its payloads. Only shards holding
    a wanted tensor are read; every tensor of those is checked against the base."""
    where = f"{store.url}/weight_v{index.version:06d}"
    if full:
        missing = sorted(set(sources) - set(index.weight_map))
        if missing:
            raise FormatError(
                f"full version {where} lacks base tensors {missing[:5]}; a full version must "
                "be complete"
            )
        if index.checksum:
            get_checksum(index.checksum)
    else:
        try:
            encoding = get_encoding(index.encoding or "").name
            check_compression(index.compression)
            get_checksum(index.checksum or "")
        except ConfigError as exc:
            raise FormatError(f"{where} cannot be replayed: {exc}") from None
    for shard, shard_names in index.shards().items():
        if wanted is not None and not wanted.intersection(shard_names):
            continue
        header = store.read_shard_header(index.version, shard)
        check_shard_names(index, shard, set(header.tensors), source=f"{where}/{shard}")
        for name in shard_names:
            entry = header.tensors[name]
            if full or name not in sources:
                _check_layout(name, entry.nbytes, sources, where)
            if wanted is not None and name not in wanted:
                continue
            digest = header.metadata.get(name)
            if full:
                overlays[name] = Overlay(
                    index.version, shard, entry.start, (), index.checksum, digest
                )
                continue
            if digest is None:
                raise FormatError(f"{where}/{shard}: tensor {name!r} has no digest")
            ref = PayloadRef(index.version, shard, entry.start, entry.end, encoding)
            previous = overlays.get(name, Overlay())
            overlays[name] = replace(
                previous, deltas=(*previous.deltas, ref), checksum=index.checksum, digest=digest
            )


def apply_lineage(
    snapshot: Snapshot, lineage: Lineage, base_sources: dict[str, TensorSource]
) -> None:
    """Point the snapshot's sources at the lineage, laid on this rank's ``base_sources``."""
    for name, overlay in lineage.overlays.items():
        snapshot.set_source(name, overlay.on(base_sources[name]))
