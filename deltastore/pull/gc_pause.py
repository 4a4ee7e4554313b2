"""The cyclic garbage collector paused for the length of a pull (as for a publish).

A pull of many tensors makes a few dozen container objects per tensor (header entries, payload
references, histories, frames, undo records); every 700 of them the collector runs, and every
few collections it walks every tracked object of the process, which in an engine or a trainer
is millions. Measured on a one-step pull of 8,000 tensors of 64 KB (the bench's MoE model, in
a process holding the model): about 360 collections, 0.5-0.9 s of a 2-3 s pull. A pull makes no
garbage cycles worth collecting meanwhile, so the collector is paused while it runs under the
host's lock and resumed after (reference counting still frees everything else).

``deltastore.publish.gc_pause`` does the same for a publish; the pull cannot import it (the
layers import only downward), so this is its own small copy with its own count.
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
