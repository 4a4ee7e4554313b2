"""Applying a batch of ``sparse-v2`` or ``auto`` payloads with the compiled kernel.

:meth:`Encoding.apply_batch` applies payloads one by one; ``sparse-v2`` and ``auto`` override it
with :func:`apply_compiled`, one call of :mod:`deltastore.codecs.jit_apply` for the whole batch
where numba is installed. A payload it refuses is run through the encoding's own
:meth:`~Encoding.apply` on a copy of its tensor, so the error is worded exactly as on the
per-tensor path (and nothing is written).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray, Encoding, PayloadBatch
from deltastore.errors import FormatError


def apply_compiled(
    encoding: Encoding,
    kernels: ModuleType,
    target: ByteArray,
    starts: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    payloads: PayloadBatch,
    names: Sequence[str],
    *,
    tagged: bool,
) -> tuple[int, FormatError | None]:
    """As :meth:`Encoding.apply_batch`, with ``kernels`` (:mod:`deltastore.codecs.jit_apply`);
    ``tagged``: the payloads are ``auto``'s."""
    if len(starts) and (int(starts.min()) < 0 or int((starts + sizes).max()) > target.size):
        # The kernel does not check indexes: a tensor outside the target is the caller's bug.
        raise ValueError(f"a tensor of {list(names)[:3]}... lies outside the target's bytes")
    index, status = kernels.apply_batch(
        target, starts, sizes, payloads.data, payloads.offsets, 0, tagged
    )
    if status == kernels.APPLIED:
        return index, None
    view = target[int(starts[index]) : int(starts[index]) + int(sizes[index])]
    return index, refusal(encoding, view, payloads[index], names[index])


def refusal(encoding: Encoding, view: ByteArray, payload: memoryview, name: str) -> FormatError:
    """The error ``encoding.apply`` gives ``payload`` for the tensor ``view`` (run on a copy)."""
    try:
        encoding.apply(view.copy(), payload, tensor=name)
    except FormatError as exc:
        return exc
    return FormatError(  # the two decoders disagree: refuse rather than apply either way
        f"{encoding.name} payload of tensor {name!r} is refused by the compiled batch decoder; "
        "it is corrupt"
    )
