"""The base-model record: base tensors' digests, kept in a stream's first delta.

A delta built on version 0 changes only some tensors; a host whose base differs from the
trainer's in a tensor the chain never touches would otherwise claim every version with wrong
bytes. The publisher records the digest of every base tensor that delta does not carry in its
index (metadata key ``base_digests``: ``{"checksum": alg, "tensors": {name: digest}}``,
covered by the signature when signed; reference readers ignore it), and a host checks its
base against that record once per seed from the base, before it copies a byte. A tensor the
delta carries needs no entry: the host checks it against its published digest once applied,
and a wrong base fails that check. Records written before this rule list every base tensor;
they are read the same way. Cost: one full hash of the base on the publisher per new stream,
and on a host, per seed from the base, a hash of the tensors the record lists.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
import sys
from collections.abc import Collection, Sequence
from typing import Any

from deltastore.codecs import Checksum, get_checksum
from deltastore.errors import FormatError, IntegrityError, NameMismatchError
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.trust.manifest import BASE_DIGESTS_KEY

_HASH_TASK_BYTES = 64 * 1024**2  # at most, per hashing task (a larger tensor is one task)
# madvise option that maps a range's pages readable in one call (Linux ≥ 5.14)
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform == "linux" else None


def _populate_read(mm: mmap.mmap) -> None:
    """Map every page of ``mm`` in one call where the OS allows it: hashing a whole file
    through a map otherwise takes a page fault per 4 KiB page."""
    if _POPULATE_READ is None:
        return
    with contextlib.suppress(OSError, ValueError):  # an older kernel: plain faults
        mm.madvise(_POPULATE_READ)


def hash_tensor(tensor: CheckpointTensor, checksum: Checksum) -> str:
    """Digest of a tensor's bytes in a checkpoint file (see :func:`hash_tensors`)."""
    return hash_tensors([tensor], checksum, workers=1)[0]


def hash_tensors(
    tensors: Sequence[CheckpointTensor], checksum: Checksum, *, workers: int = 4
) -> list[str]:
    """Digest of each tensor's bytes, in order, on ``workers`` threads: each file mapped once
    (no copy of a tensor is held), the tensors hashed in tasks of about 64 MB, so thousands of
    small tensors cost a few maps and a few dozen tasks, not one of each per tensor."""
    digests = [""] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: (tensors[i].file, tensors[i].entry.start))
    tasks: list[list[int]] = [[]]
    size = 0
    for i in order:
        if size >= _HASH_TASK_BYTES:
            tasks.append([])
            size = 0
        tasks[-1].append(i)
        size += tensors[i].entry.nbytes
    with contextlib.ExitStack() as stack:
        maps: dict[str, mmap.mmap] = {}
        for tensor in tensors:
            if tensor.file not in maps and tensor.entry.nbytes:
                fh = stack.enter_context(open(tensor.file, "rb"))
                maps[tensor.file] = stack.enter_context(
                    mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                )
                _populate_read(maps[tensor.file])

        def run(task: list[int]) -> None:
            for i in task:
                entry = tensors[i].entry
                if entry.nbytes == 0:
                    digests[i] = checksum.hexdigest(b"")
                    continue
                with memoryview(maps[tensors[i].file])[entry.start : entry.end] as view:
                    digests[i] = checksum.hexdigest(view)

        if workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                run(task)
        else:
            with cf.ThreadPoolExecutor(workers, thread_name_prefix="deltastore-hash") as pool:
                list(pool.map(run, tasks))
    return digests


def base_digests_record(base_dir: str, checksum: str, *, workers: int = 4) -> dict[str, Any]:
    """Every tensor's digest of ``base_dir`` in ``checksum`` (one full hash); a delta's index
    keeps those of the tensors it does not carry."""
    algorithm = get_checksum(checksum)
    tensors = scan_checkpoint(base_dir)
    names = sorted(tensors)
    digests = hash_tensors([tensors[n] for n in names], algorithm, workers=workers)
    return {"checksum": algorithm.name, "tensors": dict(zip(names, digests))}


def _parse(index: VersionIndex) -> tuple[str, dict[str, str]] | None:
    record = index.extra.get(BASE_DIGESTS_KEY)
    if record is None:
        return None
    where = f"weight_v{index.version:06d}"
    tensors = record.get("tensors") if isinstance(record, dict) else None
    checksum = record.get("checksum") if isinstance(record, dict) else None
    if not isinstance(checksum, str) or not isinstance(tensors, dict):
        raise FormatError(
            f"{where}: the {BASE_DIGESTS_KEY} record is malformed; the index was altered or "
            "written by an incompatible publisher"
        )
    return checksum, tensors


def check_base_names(
    base_dir: str, first_delta: VersionIndex, tensors: dict[str, CheckpointTensor]
) -> tuple[str, dict[str, str]] | None:
    """The cheap half of :func:`check_base`, from the headers alone (``tensors`` is
    ``scan_checkpoint(base_dir)``): a :class:`NameMismatchError` naming what the base lacks and
    adds; the record (checksum, digest by tensor), None when ``first_delta`` carries none."""
    parsed = _parse(first_delta)
    if parsed is None:
        return None
    expected = set(parsed[1]).union(first_delta.weight_map)  # the record omits what it carries
    if set(tensors) != expected:
        raise NameMismatchError(
            f"base {base_dir} (checked against weight_v{first_delta.version:06d}): the base "
            f"lacks {sorted(expected - set(tensors))[:5]} and has "
            f"{sorted(set(tensors) - expected)[:5]} that the trainer's base does not; "
            "pass the model the trainer was seeded from as --base"
        )
    return parsed


def check_base(
    base_dir: str,
    first_delta: VersionIndex,
    *,
    workers: int = 4,
    tensors: dict[str, CheckpointTensor] | None = None,
    covered: Collection[str] = (),
) -> bool:
    """Refuse a base that is not the one the stream was published from, by the record in
    ``first_delta`` (the delta on version 0 a seed from the base applies first); False when it
    carries none. ``tensors``: ``scan_checkpoint(base_dir)`` when the caller has it. ``covered``:
    tensors the caller checks against a published digest after writing them anyway (not hashed
    here). :class:`IntegrityError` naming the first differing tensors, :class:`NameMismatchError`
    when the base lacks or adds tensors."""
    local = tensors if tensors is not None else scan_checkpoint(base_dir)
    parsed = check_base_names(base_dir, first_delta, local)
    if parsed is None:
        return False
    checksum, expected = parsed
    algorithm = get_checksum(checksum)
    where = f"base {base_dir} (checked against weight_v{first_delta.version:06d})"
    names = sorted(set(expected).difference(covered))
    digests = hash_tensors([local[n] for n in names], algorithm, workers=workers)
    wrong = [n for n, d in zip(names, digests) if d != expected[n]]
    if wrong:
        raise IntegrityError(
            f"{where}: tensor(s) {wrong[:5]} differ from the trainer's base ({checksum}); this "
            "host's --base is not the model the stream was published from: pass the trainer's "
            "base model"
        )
    return True
