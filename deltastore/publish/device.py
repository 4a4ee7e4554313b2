"""Getting tensor bytes onto the host for the encode pool, with a bound on bytes in flight.

:class:`HostStager` turns each tensor a trainer passes into a 1-D ``uint8`` host view:

* host tensors (CPU torch tensors, numpy arrays) are viewed in place, no copy (a non-contiguous
  one is made contiguous first);
* CUDA tensors are copied into a **pinned** buffer from a reusable pool with a non-blocking
  copy, and a CUDA event marks when the bytes have landed: the encode worker waits on the
  event, so the copy of the next tensor overlaps the encode of this one. If pinned memory
  cannot be allocated, pageable buffers are used (the copy is then synchronous).

Every staged tensor holds a share of a byte budget (``limit_bytes``) until the encode worker
releases it, so the tensors queued for or inside the encode pool never exceed the budget (one
tensor larger than the budget is admitted alone). That, plus per-worker scratch, is what bounds
a publish's memory beyond the snapshot. ``stage_host_tensors=True`` sends host tensors through
the buffer pool too, so the pool, the budget and the pinning fallback can be tested on a
machine without a GPU.
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

from deltastore.codecs import ByteArray
from deltastore.errors import PublishError

log = logging.getLogger("deltastore.publish")

_MIN_BUFFER = 1 << 20


def _round_up(nbytes: int) -> int:
    """Buffer size for a tensor: the next power of two (≥ 1 MiB), so buffers are reused."""
    return max(_MIN_BUFFER, 1 << max(0, nbytes - 1).bit_length())


@dataclass
class StagerStats:
    """Counters of one :class:`HostStager` (bytes and seconds)."""

    staged: int = 0
    """Tensors staged."""
    copied: int = 0
    """Tensors copied through a pool buffer (device tensors, or host ones when forced)."""
    buffers_allocated: int = 0
    buffer_bytes_allocated: int = 0
    peak_in_flight_bytes: int = 0
    """Largest budget share held at once (buffer sizes for copies, tensor bytes for views)."""
    pinned: bool | None = None
    """True once a pinned buffer was allocated, False once pinning failed, None if never tried."""
    budget_wait_s: float = 0.0
    """Seconds the producer waited for the encode pool to release budget (backpressure)."""
    copy_wait_s: float = 0.0
    """Seconds encode workers waited for device copies to land (summed over workers)."""


class Staged:
    """One tensor's host bytes, valid until :meth:`release`."""

    def __init__(
        self,
        stager: HostStager,
        view: ByteArray,
        charge: int,
        buffer: Any = None,
        event: Any = None,
        source: Any = None,
    ) -> None:
        self._stager = stager
        self._view = view
        self._charge = charge
        self._buffer = buffer
        self._event = event
        # Keeps the device tensor alive until its non-blocking copy has landed.
        self._source = source
        self.nbytes = int(view.size)

    def wait(self) -> ByteArray:
        """The host bytes, once any pending device copy has completed."""
        if self._event is not None:
            started = time.perf_counter()
            self._event.synchronize()
            self._stager._add_copy_wait(time.perf_counter() - started)
            self._event = None
            self._source = None
        return self._view

    def release(self) -> None:
        """Return the buffer to the pool and the bytes to the budget (idempotent)."""
        if self._charge < 0:
            return
        if self._event is not None:
            # Never hand a buffer back while a copy may still be writing into it.
            self._event.synchronize()
        self._stager._release(self._charge, self._buffer)
        self._charge = -1
        self._buffer = None
        self._source = None


class HostStager:
    """Stages tensors on the host under a byte budget, reusing (pinned) copy buffers.

    ``limit_bytes`` bounds the bytes staged and not yet released. ``pin_memory=None`` pins when
    CUDA is available; ``stage_host_tensors`` copies host tensors through the pool as well
    (for tests and for callers whose host tensors change while the publish runs).
    """

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

    # -------------------------------------------------------------- budget
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

    def _add_copy_wait(self, seconds: float) -> None:
        with self._cond:
            self.stats.copy_wait_s += seconds

    @property
    def in_flight_bytes(self) -> int:
        with self._cond:
            return self._in_flight

    # ------------------------------------------------------------- buffers
    def _take_buffer(self, size: int) -> Any:
        """An idle buffer of at least ``size`` bytes, or a new one (idle ones dropped to fit)."""
        with self._cond:
            fitting = [b for b in self._idle if b.numel() >= size]
            if fitting:
                best = min(fitting, key=lambda b: b.numel())
                self._idle.remove(best)
                return best
            # Drop idle buffers so the pool never holds much more than the budget.
            ceiling = max(self.limit_bytes, self._in_flight)
            self._idle.sort(key=lambda b: b.numel())
            while self._idle and self._allocated + size > ceiling:
                self._allocated -= self._idle.pop().numel()
            self._allocated += size
        return self._allocate(size)

    def _allocate(self, size: int) -> Any:
        import torch

        pin = self._pin
        if pin is None:
            pin = torch.cuda.is_available()
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

    # ------------------------------------------------------------- staging
    def charge_for(self, tensor: Any, nbytes: int) -> int:
        """Budget bytes :meth:`stage` will hold for ``tensor`` of ``nbytes`` bytes: the bytes
        of a host view, or the pooled buffer's size for a copy."""
        if isinstance(tensor, np.ndarray) or (
            not self.stage_host_tensors and getattr(tensor, "is_cpu", False)
        ):
            return nbytes
        device = getattr(tensor, "device", None)
        on_host = device is None or getattr(device, "type", "cpu") == "cpu"
        if on_host and not self.stage_host_tensors:
            return nbytes
        if not on_host and getattr(device, "type", None) != "cuda":
            return nbytes
        return _round_up(nbytes)

    def stage(self, name: str, tensor: Any) -> Staged:
        """Host bytes of ``tensor`` (blocks while the budget is spent).

        Raises :class:`PublishError` for objects that are neither torch tensors nor numpy
        arrays.
        """
        self.stats.staged += 1
        view = None if self.stage_host_tensors else plain_host_view(tensor)
        if view is not None:
            self._acquire(view.size)
            return Staged(self, view, view.size)
        if isinstance(tensor, np.ndarray):
            view = host_bytes(name, tensor)
            self._acquire(view.size)
            return Staged(self, view, view.size)
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            torch = None  # type: ignore[assignment]
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise PublishError(
                f"tensor {name!r} is a {type(tensor).__name__}; pass a torch.Tensor or "
                "numpy.ndarray"
            )
        # detach() makes a new tensor object per call: only where autograd tracks the tensor.
        t = tensor.detach() if tensor.requires_grad else tensor
        on_host = t.device.type == "cpu"
        if on_host and not self.stage_host_tensors:
            view = host_bytes(name, t)
            self._acquire(view.size)
            return Staged(self, view, view.size)
        if not on_host and t.device.type != "cuda":
            # No pinned-copy path for other accelerators: a plain synchronous copy.
            view = host_bytes(name, t.to("cpu"))
            self._acquire(view.size)
            return Staged(self, view, view.size)
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        size = _round_up(nbytes)
        self._acquire(size)
        try:
            buffer = self._take_buffer(size)
            target = buffer[:nbytes]
            event = None
            if on_host:
                target.copy_(flat)
            else:
                pinned = buffer.is_pinned()
                target.copy_(flat, non_blocking=pinned)
                if pinned:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(t.device))
        except BaseException:
            self._release(size, None)
            raise
        self.stats.copied += 1
        return Staged(self, target.numpy(), size, buffer, event, flat if event else None)

    def close(self) -> None:
        """Drop the idle buffers (buffers still staged are dropped on release)."""
        with self._cond:
            self._idle.clear()
            self._allocated = 0


def plain_host_view(tensor: Any) -> ByteArray | None:
    """The bytes of a plain, contiguous, non-empty CPU torch tensor as a 1-D ``uint8`` view
    built from its data pointer; None for anything else (the general path handles it).

    No torch operator is dispatched: each one releases and retakes the GIL, and while the
    encode pool runs, retaking it costs the producer far more than the operator (figures in
    docs/benchmarks.md, *Many small tensors*). The view
    keeps the tensor alive. Complex tensors (maybe conjugate views), negative views, quantized
    and sparse tensors and subclasses (their bytes may not be their values) are left to the
    general path.
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
        and not _is_negative_view(torch, tensor)
    ):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return None
    memory = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    memory._tensor = tensor  # type: ignore[attr-defined]  # the view's base holds the tensor
    return np.frombuffer(memory, dtype=np.uint8)


def _is_negative_view(torch: Any, tensor: Any) -> bool:
    """True for a lazily negated view (its memory is minus its value), read from the tensor's
    dispatch keys: ``is_neg()`` is a dispatched operator that releases the GIL, and under a
    busy encode pool getting it back cost more than the rest of the staging
    (docs/benchmarks.md, *Many small tensors*)."""
    keys = getattr(torch._C, "_dispatch_keys", None)
    if keys is None:  # pragma: no cover - a torch without it
        return bool(tensor.is_neg())
    return bool(keys(tensor).has(torch._C.DispatchKey.Negative))


def host_bytes(name: str, tensor: Any) -> ByteArray:
    """The raw little-endian bytes of a host tensor/array as 1-D uint8 (contiguous first).

    Non-contiguous tensors (transposed, sliced) are made contiguous, so the bytes are the
    tensor's logical row-major content, as safetensors stores it.
    """
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.reshape(-1).view(np.uint8)
    import torch

    if isinstance(tensor, torch.Tensor):
        t = tensor.detach() if tensor.requires_grad else tensor
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.is_conj() or t.is_neg():
            # A lazily conjugated or negated view: its memory is not its value.
            t = t.resolve_conj().resolve_neg()
        t = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        # torch calls a 0- or 1-element view with stride != 1 contiguous and keeps its stride,
        # which .view(uint8) then rejects: copy it into a fresh stride-1 tensor.
        if t.stride(0) != 1:
            t = t.clone(memory_format=torch.contiguous_format)
        return t.view(torch.uint8).numpy()
    raise PublishError(
        f"tensor {name!r} is a {type(tensor).__name__}; pass a torch.Tensor or numpy.ndarray"
    )
