"""Counting and failing the writes a commit makes, with torch's own function mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

WRITES = {"index_copy_", "copy_", "index_put_", "__setitem__"}


class Writes(TorchFunctionMode):
    """Counts in-place writes into tensors; the ``fail_at``-th one raises ``error`` instead."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        super().__init__()
        self.count = 0
        self.fail_at = fail_at
        self.error = error or RuntimeError("injected device failure")

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__name__", "") in WRITES:
            self.count += 1
            if self.count == self.fail_at:
                raise self.error
        return func(*args, **(kwargs or {}))
