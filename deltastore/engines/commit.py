"""The pause: staged patches written into the live tensors, all or nothing.

Each patch is one vectorised write on the tensor's own device: on CUDA an ``index_copy_`` (or
one ``copy_`` for a whole tensor) with the positions and values moved there first; on the CPU
one numpy fancy assignment into the tensor's storage (torch's CPU indexing wakes its thread
pool for every call, which under a busy engine costs ten times the write itself).

If anything fails part way (an exception from the device, a failed verification, a
``KeyboardInterrupt``), the old values are written back at the positions already written,
newest first, and the error is raised: the live weights hold the old version again, bit for bit.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from deltastore.codecs import Digest
from deltastore.engines.patches import TensorPatch
from deltastore.engines.targets import Target, flat_bytes
from deltastore.errors import IntegrityError, PutBackError

HASH_CHUNK = 64 * 1024 * 1024
"""Bytes of a device tensor copied to the host at a time by ``verify="full"``."""

Placed = tuple[torch.Tensor | None, torch.Tensor]
"""A written patch's positions and values as they sit on the target's device."""


def write_patches(
    patches: Sequence[TensorPatch],
    targets: Mapping[str, Target],
    *,
    verify: str | None,
    expected: Callable[[TensorPatch], Digest],
    version: int,
    workers: int = 1,
) -> None:
    """Write every patch, then verify; on any failure put every written tensor back and raise
    (:class:`IntegrityError` for a failed verification, :class:`PutBackError` when the put-back
    itself fails: the live weights are then dirty)."""
    written: list[TensorPatch] = []
    placed: list[Placed] = []
    misread: list[str] = []
    check = verify == "patched"
    on_cpu = [p for p in patches if targets[p.name].device.type == "cpu"]
    spread = workers > 1 and sum(p.elements for p in on_cpu) >= SPREAD_ELEMENTS
    try:
        if spread:
            written.extend(on_cpu)  # put back whole: old values where nothing was written yet
            misread += _write_spread(on_cpu, targets, check=check, workers=workers)
        for patch in patches:
            if spread and targets[patch.name].device.type == "cpu":
                placed.append((patch.positions, patch.new))
                continue
            written.append(patch)  # before the write: a write torn by an error is put back too
            positions, new, same = _write(targets[patch.name], patch, check=check)
            placed.append((positions, new))
            if not same:
                misread.append(patch.name)
        _synchronize(targets[p.name] for p in written)
        if verify == "patched":
            _check_patched(patches, placed, targets, misread, version)
        elif verify == "full":
            _check_full(patches, targets, expected, version)
    except BaseException as exc:
        _roll_back(written, targets, exc, version)
        raise


SPREAD_ELEMENTS = 1 << 17
"""Changed CPU elements from which a commit writes on ``workers`` threads (numpy's indexed
writes release the GIL, and the pause is memory-latency bound: two threads halve it on two
cores); below it, the threads cost more than they save."""


def _write_spread(
    patches: Sequence[TensorPatch], targets: Mapping[str, Target], *, check: bool, workers: int
) -> list[str]:
    """CPU patches written on ``workers`` threads, a large one in pieces; the names of those
    whose read-back differed. Every piece has finished (or never started) when it returns or
    raises, so the put-back never races a write."""
    pieces: list[tuple[TensorPatch, slice | None]] = []
    for patch in patches:
        n = patch.elements if patch.positions is not None else 0
        step = 4 * CPU_CHUNK
        if n <= step:
            pieces.append((patch, None))
        else:
            pieces += [(patch, slice(a, a + step)) for a in range(0, n, step)]

    def write(piece: tuple[TensorPatch, slice | None]) -> str | None:
        patch, part = piece
        positions = (
            patch.positions if part is None or patch.positions is None else patch.positions[part]
        )
        values = patch.new if part is None else patch.new[part]
        same = put_words(targets[patch.name], positions, values, check=check)
        return None if same else patch.name

    pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="deltastore-commit")
    futures = [pool.submit(write, piece) for piece in pieces]
    try:
        return sorted({name for f in futures if (name := f.result()) is not None})
    finally:
        for future in futures:
            future.cancel()
        pool.shutdown(wait=True)


def _write(target: Target, patch: TensorPatch, *, check: bool) -> tuple[Any, torch.Tensor, bool]:
    """The patch written (and on the CPU read back when ``check``); its positions and values
    where they sit now, and whether the read-back matched."""
    device = target.device
    if device.type == "cpu":
        same = put_words(target, patch.positions, patch.new, check=check)
        return patch.positions, patch.new, same
    new = patch.new.to(device, non_blocking=True)
    positions = None if patch.positions is None else patch.positions.to(device, non_blocking=True)
    put_words(target, positions, new)
    return positions, new, True


CPU_CHUNK = 1 << 14
"""Positions written (then read back) at a time on the CPU: reading a piece back while its
cache lines are still hot makes ``verify="patched"`` nearly free (a separate pass over a large
tensor misses the cache again for every element)."""


def put_words(
    target: Target, positions: torch.Tensor | None, values: torch.Tensor, *, check: bool = False
) -> bool:
    """Write ``values`` at word ``positions`` of the target (all its bytes when None); the
    positions and values are on the target's device already. On the CPU with ``check``, each
    piece is read back as it is written: returns False when one differs (else True)."""
    if target.device.type != "cpu":
        if positions is None:
            target.bytes.copy_(values, non_blocking=True)
        else:
            target.words.index_copy_(0, positions, values)
        return True
    new = values.numpy()
    if positions is None:
        live = target.bytes.numpy()
        live[:] = new
        return not check or bool(np.array_equal(live, new))
    words, at = target.words.numpy(), positions.numpy()
    same = True
    for start in range(0, at.size, CPU_CHUNK):
        piece, wanted = at[start : start + CPU_CHUNK], new[start : start + CPU_CHUNK]
        words[piece] = wanted
        if check:
            same &= bool(np.array_equal(words[piece], wanted))
    return same


def _read_back(target: Target, positions: torch.Tensor | None, values: torch.Tensor) -> bool:
    if positions is None:
        return torch.equal(target.bytes, values)
    return torch.equal(target.words.index_select(0, positions), values)


def _synchronize(targets: Iterator[Target] | Sequence[Target]) -> None:
    """Wait for the writes queued on CUDA devices (their errors surface here)."""
    for device in {t.device for t in targets if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _check_patched(
    patches: Sequence[TensorPatch],
    placed: Sequence[Placed],
    targets: Mapping[str, Target],
    misread: Sequence[str],
    version: int,
) -> None:
    """Read back the written positions on devices (the CPU's were read back as they were
    written: ``misread``) and compare them with the staged values."""
    bad = list(misread) + [
        patch.name
        for patch, (positions, new) in zip(patches, placed, strict=True)
        if targets[patch.name].device.type != "cpu"
        and not _read_back(targets[patch.name], positions, new)
    ]
    if bad:
        raise IntegrityError(
            f"v{version:06d}: tensors {bad[:5]} do not read back the values just written "
            f"({len(bad)} in all); the commit was rolled back"
        )


def digest_of(tensor: torch.Tensor, digest: Digest) -> bool:
    """Whether ``tensor``'s bytes hash to ``digest`` (device tensors copied in chunks)."""
    hasher = digest.checksum.hasher()
    flat = flat_bytes(tensor)
    for start in range(0, flat.numel(), HASH_CHUNK):
        piece = flat[start : start + HASH_CHUNK]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        hasher.update(memoryview(piece.numpy()))
    return hasher.hexdigest() == digest.hex


def _check_full(
    patches: Sequence[TensorPatch],
    targets: Mapping[str, Target],
    expected: Callable[[TensorPatch], Digest],
    version: int,
) -> None:
    """Hash every committed tensor against the version's digest of it."""
    bad = [p.name for p in patches if not digest_of(targets[p.name].tensor, expected(p))]
    if bad:
        raise IntegrityError(
            f"v{version:06d}: tensors {bad[:5]} do not match the version's digests after the "
            f"commit ({len(bad)} in all); the commit was rolled back"
        )


def _roll_back(
    written: Sequence[TensorPatch],
    targets: Mapping[str, Target],
    cause: BaseException,
    version: int,
) -> None:
    caught: list[int] = []
    try:
        with _interrupts_deferred(caught):
            for patch in reversed(written):
                target = targets[patch.name]
                positions = patch.positions
                put_words(
                    target,
                    None if positions is None else positions.to(target.device),
                    patch.old.to(target.device),
                )
            _synchronize(targets[p.name] for p in written)
    except BaseException as exc:
        raise PutBackError(
            f"committing v{version:06d} failed ({cause!r}) and putting the live weights back "
            f"failed too ({exc!r}): they are dirty. Reload the engine from the local checkpoint"
        ) from cause
    if caught and not isinstance(cause, KeyboardInterrupt):
        raise KeyboardInterrupt from cause


@contextlib.contextmanager
def _interrupts_deferred(caught: list[int]) -> Iterator[None]:
    """Hold Ctrl-C back while the old values go back (on the main thread, where it lands);
    one that arrives meanwhile is recorded in ``caught`` and raised once they are back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hold(signum: int, frame: Any) -> None:
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
