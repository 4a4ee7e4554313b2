"""The optional compiled path of ``sparse-v2`` encoding (numba, the ``fast`` extra).

``pip install 'deltastore[fast]'`` installs numba; then :class:`CompactSparseEncoding` encodes
with one compiled pass per tensor instead of a few dozen numpy calls (the numpy path writes the
same bytes). Setting ``DELTASTORE_NO_JIT=1`` keeps the numpy path even where numba is installed.

The kernels compile on first use in a process: about 2-4 s per element size the first time on a
machine, then they load from numba's on-disk cache (``cache=True``, next to the module or in
``NUMBA_CACHE_DIR``) in well under a second. Numba itself takes about half a second to import;
both happen at the first encode, never at ``import deltastore``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from deltastore.codecs.base import ByteArray, XorChanges
from deltastore.errors import ConfigError

Encoder = Callable[[ByteArray, ByteArray, int], tuple[memoryview | bytes, XorChanges]]

NO_JIT_VARIABLE = "DELTASTORE_NO_JIT"
_lock = threading.Lock()
_loaded: dict[str, Encoder | None] = {}


def _load() -> Encoder | None:
    """The compiled encoder, imported once per process; None where numba is not installed."""
    with _lock:
        if "encode" not in _loaded:
            try:
                from deltastore.codecs.jit_kernels import encode
            except ImportError:
                _loaded["encode"] = None
            else:
                _loaded["encode"] = encode
        return _loaded["encode"]


def encoder(use_jit: bool | None) -> Encoder | None:
    """The compiled encoder to use, or None for numpy: ``use_jit`` False is numpy, True needs
    numba (:class:`ConfigError` without it), None takes numba when it is importable and
    ``DELTASTORE_NO_JIT`` is unset or ``0``."""
    if use_jit is False:
        return None
    if use_jit is None and os.environ.get(NO_JIT_VARIABLE, "0") not in ("", "0"):
        return None
    kernel = _load()
    if kernel is None and use_jit:
        raise ConfigError(
            "the compiled sparse-v2 encoder needs numba: pip install 'deltastore[fast]'"
        )
    return kernel
