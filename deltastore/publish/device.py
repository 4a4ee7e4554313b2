"""Getting tensor bytes onto the host for the encode pool, with a bound on bytes in flight.

:class:`HostStager` views host tensors and numpy arrays in place as 1-D ``uint8``, and copies
CUDA tensors into reusable **pinned** buffers (pageable where pinning fails) without blocking:
the encode worker waits on the copy's event, so the next copy overlaps this encode. Each staged
tensor holds a share of the ``limit_bytes`` budget until released (a larger one goes alone).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltastore.codecs import ByteArray, Checksum, XorChanges, element_size
from deltastore.errors import PublishError

log = logging.getLogger("deltastore.publish")


def _round_up(nbytes: int) -> int:
    """Buffer size for a tensor: the next power of two (≥ 1 MiB), so buffers are reused."""
    return max(1 << 20, 1 << max(0, nbytes - 1).bit_length())


@dataclass
class StagerStats:
    """Counters of one :class:`HostStager`. ``peak_in_flight_bytes`` counts buffer sizes for
    copies, tensor bytes for views; ``pinned`` is None until a pinned buffer is tried; the
    waits are the producer's for budget and the encode workers' for device copies."""

    staged: int = 0
    copied: int = 0
    buffers_allocated: int = 0
    buffer_bytes_allocated: int = 0
    peak_in_flight_bytes: int = 0
    pinned: bool | None = None
    budget_wait_s: float = 0.0
    copy_wait_s: float = 0.0
    device_diffed: int = 0
    """Tensors diffed against their copy on the device (``device_snapshot``)."""
    device_uploads: int = 0
    """Tensors whose device copy was made from the host snapshot (first use, or after it was
    dropped)."""
    device_bytes_to_host: int = 0
    """Bytes the device diff sent to the host: each changed element's position, XOR value and
    old value (checked against the host snapshot)."""


@dataclass(eq=False)
class Staged:
    """One tensor's host bytes, valid until :meth:`release`; ``source`` keeps a device tensor
    alive until its non-blocking copy (``event``) has landed. A tensor staged in a group
    (:meth:`HostStager.stage_group`) holds ``shared``, the group's own :class:`Staged`, whose
    buffer returns to the pool when the last of its ``users`` is released."""

    stager: HostStager
    view: ByteArray
    charge: int
    buffer: Any = None
    event: Any = None
    source: Any = None
    shared: Staged | None = None
    users: int = 1

    def wait(self) -> ByteArray:
        """The host bytes, once any pending device copy has completed."""
        owner = self.shared or self
        event = owner.event  # read once: another member may clear it meanwhile
        if event is not None:
            started = time.perf_counter()
            event.synchronize()
            owner.stager._add_copy_wait(time.perf_counter() - started)
            owner.event = None
            owner.source = None
        return self.view

    def release(self) -> None:
        """Return the buffer to the pool and the bytes to the budget (idempotent)."""
        if self.charge < 0:
            return
        charge, self.charge = self.charge, -1
        if self.shared is not None:
            self.stager._release_member(self.shared)
            return
        event = self.event
        if event is not None:
            # Never hand a buffer back while a copy may still be writing into it.
            event.synchronize()
        self.stager._release(charge, self.buffer)
        self.buffer = None
        self.source = None


class HostStager:
    """Stages tensors under a budget of ``limit_bytes`` staged and not released, reusing copy
    buffers (``pin_memory=None``: pinned when CUDA is available); ``stage_host_tensors`` copies
    host tensors too (tests, callers whose host tensors change meanwhile)."""

    def __init__(
        self,
        limit_bytes: int,
        *,
        pin_memory: bool | None = None,
        stage_host_tensors: bool = False,
    ) -> None:
        if limit_bytes < 1:
            raise PublishError(f"the in-flight byte budget must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.stage_host_tensors = stage_host_tensors
        self._pin = pin_memory
        self._cond = threading.Condition()
        self._in_flight = 0
        self._idle: list[Any] = []
        self._allocated = 0
        self.stats = StagerStats()

    def _acquire(self, charge: int) -> None:
        started = time.perf_counter()
        with self._cond:
            # A tensor larger than the whole budget goes alone, once everything else is done.
            while self._in_flight and self._in_flight + charge > self.limit_bytes:
                self._cond.wait()
            self._in_flight += charge
            self.stats.peak_in_flight_bytes = max(self.stats.peak_in_flight_bytes, self._in_flight)
        self.stats.budget_wait_s += time.perf_counter() - started

    def _release(self, charge: int, buffer: Any) -> None:
        with self._cond:
            self._in_flight -= charge
            if buffer is not None:
                self._idle.append(buffer)
            self._cond.notify_all()

    def _release_member(self, group: Staged) -> None:
        """One tensor of a group released: the group's buffer goes back with its last."""
        with self._cond:
            group.users -= 1
            last = group.users == 0
        if last:
            group.release()

    def _add_copy_wait(self, seconds: float) -> None:
        with self._cond:  # encode workers add theirs at once
            self.stats.copy_wait_s += seconds

    @property
    def in_flight_bytes(self) -> int:
        with self._cond:
            return self._in_flight

    def _take_buffer(self, size: int) -> Any:
        """An idle buffer of at least ``size`` bytes, or a new one (idle ones dropped to fit)."""
        with self._cond:
            # By position: list.remove() would compare buffers with ==, elementwise on tensors.
            fitting = [i for i, b in enumerate(self._idle) if b.numel() >= size]
            if fitting:
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].numel()))
            # Drop idle buffers so the pool never holds much more than the budget.
            ceiling = max(self.limit_bytes, self._in_flight)
            self._idle.sort(key=lambda b: b.numel())
            while self._idle and self._allocated + size > ceiling:
                self._allocated -= self._idle.pop().numel()
            self._allocated += size
        return self._allocate(size)

    def _allocate(self, size: int) -> Any:
        import torch

        pin = torch.cuda.is_available() if self._pin is None else self._pin
        buffer = None
        if pin and self.stats.pinned is not False:
            try:
                buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                self.stats.pinned = True
            except RuntimeError as exc:
                log.warning("pinned host memory unavailable (%s); using pageable buffers", exc)
                self.stats.pinned = False
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8)
        self.stats.buffers_allocated += 1
        self.stats.buffer_bytes_allocated += size
        return buffer

    def pooled(self, tensor: Any) -> bool:
        """Whether :meth:`stage` copies ``tensor`` through a pool buffer: a CUDA tensor, or a
        host one with ``stage_host_tensors`` (everything else is viewed or copied plainly)."""
        kind = getattr(getattr(tensor, "device", None), "type", None)  # numpy's device: a str
        return kind == "cuda" or (kind == "cpu" and self.stage_host_tensors)

    def charge_for(self, tensor: Any, nbytes: int) -> int:
        """Budget bytes :meth:`stage` will hold for ``tensor``: a view's bytes, a copy's buffer."""
        return _round_up(nbytes) if self.pooled(tensor) else nbytes

    def stage(self, name: str, tensor: Any) -> Staged:
        """Host bytes of ``tensor`` (blocks while the budget is spent); :class:`PublishError`
        for objects that are neither torch tensors nor numpy arrays."""
        self.stats.staged += 1
        view = None if self.stage_host_tensors else plain_host_view(tensor)
        if view is None and not self.pooled(tensor):
            view = host_bytes(name, tensor)  # other accelerators: a plain synchronous copy
        if view is not None:
            self._acquire(view.size)
            return Staged(self, view, view.size)
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise not_a_tensor(name, tensor)
        staged = self._pool_copy(torch, [flat_bytes(torch, tensor)])
        self.stats.copied += 1
        return staged

    def _pool_copy(self, torch: Any, flats: list[Any]) -> Staged:
        """``flats`` (1-D ``uint8``, on one device) end to end in one pool buffer, copied
        without blocking from a device (the :class:`Staged` waits on the copy's event)."""
        total = sum(int(flat.numel()) for flat in flats)
        size = _round_up(total)
        self._acquire(size)
        try:
            buffer = self._take_buffer(size)
            target = buffer[:total]
            event = joined = None
            if flats[0].device.type == "cpu":
                torch.cat(flats, out=target)
            else:
                joined = flats[0] if len(flats) == 1 else torch.cat(flats)
                pinned = buffer.is_pinned()
                target.copy_(joined, non_blocking=pinned)
                if pinned:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(joined.device))
        except BaseException:
            self._release(size, None)
            raise
        return Staged(self, target.numpy(), size, buffer, event, joined if event else None)

    def group_charge(self, nbytes: int) -> int:
        """Budget bytes :meth:`stage_group` holds for tensors of ``nbytes`` in all."""
        return _round_up(nbytes)

    def stage_group(self, flats: list[Any]) -> list[Staged]:
        """Stage the bytes of several small tensors (1-D ``uint8``, on one device) that
        :meth:`stage` would copy through the pool one by one, into one pool buffer: one
        concatenation on their device, one copy and one event for all. Each torch call the
        producer makes releases and retakes the GIL, which under a busy encode pool costs it
        far more than a small copy. The buffer returns when the last of them is released."""
        import torch

        if len({flat.device for flat in flats}) > 1:
            raise PublishError("a staged group must hold tensors of one device")
        self.stats.staged += len(flats)
        group = self._pool_copy(torch, flats)
        self.stats.copied += len(flats)
        group.users = len(flats)
        sizes = [int(flat.numel()) for flat in flats]
        ends = np.cumsum(sizes).tolist()
        return [
            Staged(self, group.view[end - n : end], 0, shared=group)
            for n, end in zip(sizes, ends, strict=True)
        ]

    def close(self) -> None:
        """Drop the idle buffers (buffers still staged are dropped on release)."""
        with self._cond:
            self._idle.clear()
            self._allocated = 0


def plain_host_view(tensor: Any) -> ByteArray | None:
    """The bytes of a plain, contiguous, non-empty CPU torch tensor as a 1-D ``uint8`` view
    built from its data pointer (the view keeps the tensor alive); None for anything else.

    No torch operator is dispatched: each releases and retakes the GIL, which under a busy
    encode pool costs the producer far more than the operator. Tensors whose bytes may not be
    their values (complex, negative views, quantized, sparse, subclasses) take the general path.
    """
    torch = sys.modules.get("torch")
    kind = type(tensor)
    if torch is None or (kind is not torch.Tensor and kind is not torch.nn.Parameter):
        return None
    if not (
        tensor.is_cpu
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not tensor.is_quantized
        and not tensor.dtype.is_complex  # a conjugate view; is_conj() is a dispatched operator
        # A lazily negated view, read from the dispatch keys: is_neg() is an operator too.
        and not torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Negative)
    ):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return None
    memory = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    memory._tensor = tensor  # type: ignore[attr-defined]  # the view's base holds the tensor
    return np.frombuffer(memory, dtype=np.uint8)


def host_bytes(name: str, tensor: Any) -> ByteArray:
    """The raw little-endian bytes of a tensor/array as 1-D uint8 on the host: its logical
    row-major content, as safetensors stores it, whatever its layout or device."""
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.reshape(-1).view(np.uint8)
    import torch

    if isinstance(tensor, torch.Tensor):
        return flat_bytes(torch, tensor).cpu().numpy()
    raise not_a_tensor(name, tensor)


def flat_bytes(torch: Any, tensor: Any) -> Any:
    """A torch tensor's logical row-major bytes as a 1-D ``uint8`` tensor on its device: a
    lazily conjugated or negated view resolved (its memory is not its value), a non-contiguous
    one made contiguous, and a 0- or 1-element view with stride != 1 (torch calls it contiguous
    and keeps the stride, which ``.view(uint8)`` rejects) copied into a fresh one."""
    # detach() makes a new tensor object per call: only where autograd tracks the tensor.
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if t.stride(0) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def not_a_tensor(name: str, tensor: Any) -> PublishError:
    return PublishError(
        f"tensor {name!r} is a {type(tensor).__name__}; pass a torch.Tensor or numpy.ndarray"
    )


DEVICE_INTS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
"""torch's integer type of each element size: the device diff compares and XORs in these
(signed: torch's unsigned types lack the bitwise operators on some devices)."""
DIGEST_CHUNK = 1024**2
"""Bytes of the new state rebuilt at a time for its digest: the piece stays in cache."""


GROUP_TENSOR_BYTES = 1 << 20
"""Torch tensors smaller than this that would take device calls of their own (diffed on their
device, or copied through the pool) are handled in groups of up to a pool task's batch: a
handful of calls, and of waits for the device, for a group instead of for each tensor, which
a model of tens of thousands of small tensors (MoE experts) would pay per tensor."""


class DeviceSnapshot:
    """``device_snapshot``: each tensor's last published state beside the trainer's tensor, on
    its device, so the diff runs there and only the changed elements (positions, XOR and old
    values) cross to the host: torch ops, so the same code runs on CPU tensors. It costs one
    more copy of the rank's tensors in device memory, made from the host snapshot on first use;
    the host snapshot stays the state every other step reads."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}
        self._scratch: dict[tuple[str, Any], Any] = {}

    def _concatenated(self, which: str, tensors: list[Any]) -> Any:
        """``tensors`` (1-D ``uint8``, on one device) end to end in a buffer kept for the
        next group: on CPU a fresh one would pay a page fault per 4 KiB, more than the copy."""
        import torch

        nbytes = sum(int(t.numel()) for t in tensors)
        key = (which, tensors[0].device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
            self._scratch[key] = buffer
        return torch.cat(tensors, out=buffer[:nbytes])

    @staticmethod
    def groupable(tensor: Any, nbytes: int) -> bool:
        """Whether ``tensor`` is diffed in a group: a non-empty torch tensor under
        :data:`GROUP_TENSOR_BYTES`."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(tensor, torch.Tensor):
            return False
        return 0 < nbytes < GROUP_TENSOR_BYTES

    def _copy_for(self, name: str, flat: Any, old: ByteArray, stats: StagerStats) -> Any:
        """The tensor's device copy, made from the host snapshot ``old`` where it has none on
        ``flat``'s device."""
        held = self._held.get(name)
        if held is None or held.device != flat.device:
            import torch

            held = torch.from_numpy(old).to(flat.device, copy=True)  # (on CPU: not the host's)
            self._held[name] = held
            stats.device_uploads += 1
        return held

    def changes(
        self, name: str, tensor: Any, old: ByteArray, itemsize: int, stats: StagerStats
    ) -> XorChanges | None:
        """The change from the published ``old`` (host bytes) to ``tensor``, found on its
        device; None for what is not a torch tensor, where the change would be larger than the
        tensor (a dense step), or where the device copy disagrees with ``old`` at a changed
        element (a copy left behind by a bug: dropped, with a warning): staged whole instead."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(tensor, torch.Tensor):
            return None
        if not old.size:  # nothing to change (and torch will not view an empty one as ints)
            stats.device_diffed += 1
            size = element_size(old.size, itemsize)
            return XorChanges(np.zeros(0, np.int64), np.zeros(0, f"<u{size}"))
        return self.changes_of_group([(name, tensor, old, itemsize)], stats)[0]

    def changes_of_group(
        self,
        tensors: list[tuple[str, Any, ByteArray, int]],
        stats: StagerStats,
        *,
        as_bytes: bool = False,
    ) -> list[XorChanges | None]:
        """:meth:`changes` of non-empty torch tensors (name, tensor, ``old``, item size), in
        input order (``as_bytes``: each tensor given as its bytes, 1-D ``uint8``): per element
        size and device, several are concatenated there and diffed in one pass, and one
        transfer brings the changes of all. A group whose changes would take more bytes than
        its tensors goes tensor by tensor, so a dense step sends no more than each tensor
        alone would."""
        import torch

        found: list[XorChanges | None] = [None] * len(tensors)
        members: dict[tuple[int, Any], list[tuple[int, Any]]] = {}
        for index, (_, tensor, old, itemsize) in enumerate(tensors):
            flat = tensor if as_bytes else flat_bytes(torch, tensor)
            members.setdefault((element_size(old.size, itemsize), flat.device), []).append(
                (index, flat)
            )
        for (size, _), flats in members.items():
            if not self._diff_together(tensors, flats, size, found, stats):
                for one in flats:
                    self._diff_together(tensors, [one], size, found, stats)
        return found

    def _diff_together(
        self,
        tensors: list[tuple[str, Any, ByteArray, int]],
        flats: list[tuple[int, Any]],
        size: int,
        found: list[XorChanges | None],
        stats: StagerStats,
    ) -> bool:
        """Diff ``flats`` (an index into ``tensors`` and the tensor's bytes, all on one device)
        in one pass into ``found``: a count, a ``nonzero`` and one transfer, the device's only
        waits. False, with nothing sent, where several would send more than their bytes."""
        import torch

        kind = getattr(torch, DEVICE_INTS[size])
        copies = [self._copy_for(tensors[i][0], flat, tensors[i][2], stats) for i, flat in flats]
        if len(flats) == 1:  # no concatenation: a large tensor is diffed where it lies
            before, after = copies[0].view(kind), flats[0][1].view(kind)
        else:
            before = self._concatenated("copies", copies).view(kind)
            after = self._concatenated("tensors", [flat for _, flat in flats]).view(kind)
        differs = before != after
        if int(torch.count_nonzero(differs)) * (8 + size) > before.numel() * size:
            if len(flats) > 1:
                return False
            stats.device_diffed += 1
            return True  # dense: staged whole
        stats.device_diffed += len(flats)
        positions = differs.nonzero().reshape(-1)
        held_values = before[positions]
        values = held_values ^ after[positions]
        sent = torch.cat([t.view(torch.uint8) for t in (positions, values, held_values)])
        host = sent.cpu().numpy()
        stats.device_bytes_to_host += host.size
        count, unsigned = positions.numel(), np.dtype(f"<u{size}")
        at = host[: 8 * count].view(np.int64)
        xors = host[8 * count : (8 + size) * count].view(unsigned)
        helds = host[(8 + size) * count :].view(unsigned)
        starts = np.cumsum([0] + [flat.numel() // size for _, flat in flats])
        bounds = np.searchsorted(at, starts)
        for k, (i, _) in enumerate(flats):
            name, _, old, _ = tensors[i]
            lo, hi = bounds[k], bounds[k + 1]
            if (hi - lo) * (8 + size) > old.size:
                continue  # dense: staged whole
            changed = XorChanges(at[lo:hi] - starts[k], xors[lo:hi])
            found[i] = self._checked(name, old, changed, helds[lo:hi])
        return True

    def _checked(
        self, name: str, old: ByteArray, changed: XorChanges, held_values: np.ndarray
    ) -> XorChanges | None:
        """``changed``, where the copy's old values at its elements are the host snapshot's;
        else None, the copy dropped with a warning. A stale copy would otherwise publish a
        version whose digest matches its own wrong bytes. Only the changed elements can be
        checked: an element where a stale copy equals the new value goes unseen, so the copy's
        correctness rests on :meth:`advance` and :meth:`forget`, not on this check."""
        if np.array_equal(held_values, old.view(held_values.dtype)[changed.positions]):
            return changed
        log.warning(
            "tensor %r: its copy on %s is not the published state; staging it whole and "
            "making the copy again",
            name,
            self._held[name].device,
        )
        del self._held[name]
        return None

    def advance(self, name: str, changes: XorChanges | None) -> None:
        """Move a tensor's device copy to the committed version (None: drop it, to be made
        again from the host snapshot on its next use)."""
        self.advance_all([(name, changes)])

    def advance_all(self, moved: list[tuple[str, XorChanges | None]]) -> None:
        """:meth:`advance` of many tensors: per device and element size, their changes go
        over in one transfer, then each copy is XORed in place there (no wait per tensor)."""
        import torch

        by_kind: dict[tuple[Any, int], list[tuple[Any, XorChanges]]] = {}
        for name, changes in moved:
            held = self._held.get(name)
            if held is None:
                continue
            if changes is None:
                del self._held[name]
            elif changes.positions.size:
                size = changes.values.dtype.itemsize
                by_kind.setdefault((held.device, size), []).append((held, changes))
        for (device, size), pairs in by_kind.items():
            counts = [int(changes.positions.size) for _, changes in pairs]
            packed = np.concatenate(
                [np.ascontiguousarray(c.positions, np.int64).view(np.uint8) for _, c in pairs]
                + [np.ascontiguousarray(c.values).view(np.uint8) for _, c in pairs]
            )
            sent = torch.from_numpy(packed).to(device)
            total = sum(counts)
            positions = sent[: 8 * total].view(torch.int64).split(counts)
            values = sent[8 * total :].view(getattr(torch, DEVICE_INTS[size])).split(counts)
            for (held, _), at, xors in zip(pairs, positions, values, strict=True):
                held.view(xors.dtype)[at] ^= xors

    def forget(self, name: str) -> None:
        self._held.pop(name, None)

    @property
    def held_bytes(self) -> int:
        return sum(int(t.numel()) for t in self._held.values())


def hexdigest_after(checksum: Checksum, old: ByteArray, changes: XorChanges) -> str:
    """The digest of ``old`` with ``changes`` XORed in, without a copy of the whole tensor:
    rebuilt :data:`DIGEST_CHUNK` bytes at a time into one buffer that stays in cache."""
    size = changes.values.dtype.itemsize
    per_chunk = DIGEST_CHUNK // size
    positions = changes.positions
    hasher = checksum.hasher()
    piece = np.empty(min(DIGEST_CHUNK, old.size), np.uint8)
    for first in range(0, old.size // size, per_chunk):
        start = first * size
        chunk = piece[: min(DIGEST_CHUNK, old.size - start)]
        chunk[:] = old[start : start + chunk.size]
        lo, hi = np.searchsorted(positions, (first, first + per_chunk))
        if hi > lo:
            chunk.view(changes.values.dtype)[positions[lo:hi] - first] ^= changes.values[lo:hi]
        hasher.update(memoryview(chunk))
    return hasher.hexdigest()
