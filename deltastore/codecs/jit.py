"""The optional compiled path of ``sparse-v2`` (numba, the ``fast`` extra).

``pip install 'deltastore[fast]'`` installs numba; then :class:`CompactSparseEncoding` encodes
and decodes with one compiled pass per tensor instead of a few dozen numpy calls (the numpy
path writes the same bytes and accepts and refuses the same payloads). Setting
``DELTASTORE_NO_JIT=1`` keeps the numpy path even where numba is installed.

The kernels compile on first use in a process: about 2-4 s per element size the first time on a
machine, then they load from numba's on-disk cache (``cache=True``, next to the module or in
``NUMBA_CACHE_DIR``) in well under a second. Numba itself takes about half a second to import;
both happen at the first encode, never at ``import deltastore``.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import os
import threading
from types import ModuleType

from deltastore.errors import ConfigError

NO_JIT_VARIABLE = "DELTASTORE_NO_JIT"
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


KERNEL_SOURCES = "jit_*.py"
"""The kernel modules: numba compiles a kernel together with the kernels it calls from the
other modules, but keys its on-disk cache on the kernel's own file alone."""
STAMP_NAME = "deltastore-kernels.stamp"


def drop_stale_kernels(directory: str = os.path.dirname(__file__)) -> bool:
    """Remove the cached compiled kernels next to the kernel modules in ``directory`` when any
    of those modules changed since they were cached; True when some were removed.

    Numba would reload a kernel whose own file is unchanged even after a kernel it calls in
    another module changed (``jit_batch`` calls ``jit_kernels``, which calls ``jit_changes``),
    running the old code. A digest of every kernel module, kept beside the cache, catches that.
    Only the cache in ``__pycache__`` is checked (not a ``NUMBA_CACHE_DIR``); one that cannot
    be written is left alone.
    """
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(directory, KERNEL_SOURCES))):
        with open(path, "rb") as fh:
            digest.update(os.path.basename(path).encode() + b"\0" + fh.read())
    cache = os.path.join(directory, "__pycache__")
    stamp = os.path.join(cache, STAMP_NAME)
    try:
        with open(stamp) as fh:
            if fh.read() == digest.hexdigest():
                return False
    except OSError:
        pass
    stale = glob.glob(os.path.join(cache, "jit_*.nb[ic]"))
    try:
        for path in stale:
            os.remove(path)
        os.makedirs(cache, exist_ok=True)
        with open(stamp, "w") as fh:
            fh.write(digest.hexdigest())
    except OSError:
        return False  # a read-only install: nothing there was compiled from other sources
    return bool(stale)


def _load(module: str) -> ModuleType | None:
    """``deltastore.codecs.<module>`` (a module of kernels), imported once per process; None
    without numba."""
    with _lock:
        if not _loaded:
            drop_stale_kernels()
        if module not in _loaded:
            try:
                _loaded[module] = importlib.import_module(f"deltastore.codecs.{module}")
            except ImportError:
                _loaded[module] = None
        return _loaded[module]


def apply_kernels(use_jit: bool | None) -> ModuleType | None:
    """The compiled batch apply (:mod:`deltastore.codecs.jit_apply`), or None where
    :func:`kernels` would give None (same ``use_jit`` and ``DELTASTORE_NO_JIT`` rules)."""
    if kernels(use_jit) is None:
        return None
    return _load("jit_apply")


def kernels(use_jit: bool | None) -> ModuleType | None:
    """The compiled kernels to use (``encode``, ``decode``, ``apply_steps``), or None for
    numpy: ``use_jit`` False is numpy, True needs numba (:class:`ConfigError` without it), None
    takes numba when it is importable and ``DELTASTORE_NO_JIT`` is unset or ``0``."""
    if use_jit is False:
        return None
    if use_jit is None and os.environ.get(NO_JIT_VARIABLE, "0") not in ("", "0"):
        return None
    module = _load("jit_kernels")
    if module is None and use_jit:
        raise ConfigError(
            "the compiled sparse-v2 codec needs numba: pip install 'deltastore[fast]'"
        )
    return module


def batch_kernels(use_jit: bool | None) -> ModuleType | None:
    """The compiled batch encoder's module (``encode_batch``, :mod:`.jit_batch`) on the terms of
    :func:`kernels`; None for numpy."""
    if kernels(use_jit) is None:
        return None
    return _load("jit_batch")
