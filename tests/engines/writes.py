"""Counting and failing the writes a commit makes into the live tensors.

Every write of a commit (and of its rollback) goes through ``deltastore.engines.commit.
put_words``, one call per tensor; :class:`Writes` wraps it for the length of a ``with`` block:
it counts the calls, and the ``fail_at``-th raises ``error`` (a device failure, a Ctrl-C)
before writing. The other calls write for real.
"""

from __future__ import annotations

from typing import Any

import pytest

from deltastore.engines import commit


class Writes:
    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.count = 0
        self.fail_at = fail_at
        self.error = error or RuntimeError("injected device failure")
        self._patch = pytest.MonkeyPatch()

    def __enter__(self) -> Writes:
        real = commit.put_words

        def put_words(*args: Any, **kwargs: Any) -> bool:
            self.count += 1
            if self.count == self.fail_at:
                raise self.error
            return real(*args, **kwargs)

        self._patch.setattr(commit, "put_words", put_words)
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.undo()
