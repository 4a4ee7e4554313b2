"""Retries of whole idempotent store steps under one deadline (tenacity).

s3fs and gcsfs already retry single HTTP calls underneath, so deltastore does not wrap every
call: it retries a whole idempotent step (read an index, write a shard) a few times with
jittered exponential backoff, bounded in attempts and in total time, and only for errors that
can pass (see :func:`is_transient`). Permanent errors fail at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from deltastore.errors import TransientStoreError

log = logging.getLogger("deltastore.storage")

T = TypeVar("T")

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
    "OperationAborted",
    # a streamed body cut short (botocore's wrappers, aiohttp's own)
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientPayloadError",
}


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status", "code", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: 5xx, 429, S3's 409 ConditionalRequestConflict,
    throttling, timeouts and connection resets."""
    if isinstance(exc, TransientStoreError):
        return True
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status = _status_of(exc)
    # 501 Not Implemented and 505 HTTP Version Not Supported will not pass on retry.
    if status is not None and status not in (501, 505) and (status >= 500 or status in (408, 429)):
        return True
    text = f"{type(exc).__name__} {exc}"
    if any(code in text for code in _TRANSIENT_CODES):
        return True
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        return is_transient(cause)
    return False


def _stop_by_deadline(deadline_s: float) -> tenacity.stop.stop_base:
    """Stop before a wait would end past the deadline (older tenacity: stop after it)."""
    stop_before = getattr(tenacity, "stop_before_delay", None)
    if stop_before is not None:
        return stop_before(deadline_s)  # type: ignore[no-any-return]
    return tenacity.stop_after_delay(deadline_s)


@dataclass(frozen=True)
class RetryPolicy:
    """How a store retries a failed idempotent step: ``attempts`` tries in all, none started
    after ``deadline_s``."""

    attempts: int = 5
    deadline_s: float = 60.0
    initial_wait_s: float = 0.2
    max_wait_s: float = 5.0
    sleep: Callable[[float], None] | None = None
    """Injectable sleep (tests assert waits without waiting)."""

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures (``what`` names the step in logs); the last
        error is re-raised unchanged once the attempts or the deadline are spent."""

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s failed (attempt %d of %d, retrying in %.2f s): %s",
                what,
                state.attempt_number,
                self.attempts,
                state.upcoming_sleep,
                exc,
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts) | _stop_by_deadline(self.deadline_s),
            wait=tenacity.wait_random_exponential(
                multiplier=self.initial_wait_s, max=self.max_wait_s
            ),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=log_retry,
            reraise=True,
            sleep=self.sleep or time.sleep,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            if is_transient(exc):
                log.error("%s: giving up after %d attempt(s): %s", what, attempts, exc)
            raise
