"""The cyclic garbage collector paused for the length of a publish or a pull.

Both make a few long-lived objects per tensor; every few thousand of them the collector runs a
full collection, which walks every tracked object of the process (a trainer holds millions).
Neither makes garbage cycles worth collecting meanwhile, so the collector is paused while they
run (reference counting still frees everything else). One module for both sides, so a publish
and a pull in one process share the pause and only the last resumes it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause automatic garbage collection inside the block (nested and concurrent blocks
    share one pause; the collector is resumed by the last to leave, and only if it was on)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
