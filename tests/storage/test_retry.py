"""RetryPolicy and is_transient: which errors are retried, how long the waits are (recorded
through an injected sleep, never slept), and that retries stop by count and by deadline."""

from __future__ import annotations

import errno
import logging
import time

import pytest
from botocore.exceptions import ClientError
from gcsfs.retry import HttpError

from deltastore.errors import StoreError, TransientStoreError
from deltastore.storage import RetryPolicy, is_transient


def s3_client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def chained(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (TransientStoreError("try again"), True),
        (s3_client_error("ServiceUnavailable", 503), True),
        (s3_client_error("SlowDown", 503), True),
        (s3_client_error("InternalError", 500), True),
        (s3_client_error("ConditionalRequestConflict", 409), True),
        (OSError(errno.EIO, "An error occurred (ConditionalRequestConflict) when calling"), True),
        (HttpError({"code": 503, "message": "backend error"}), True),
        (HttpError({"code": 429, "message": "rate limit"}), True),
        (chained(RuntimeError("wrapped"), ConnectionResetError()), True),
        (PermissionError("Forbidden"), False),
        (FileNotFoundError("no such key"), False),
        (FileExistsError("precondition failed"), False),
        (s3_client_error("AccessDenied", 403), False),
        (s3_client_error("InvalidRequest", 400), False),
        (HttpError({"code": 404, "message": "not found"}), False),
        (HttpError({"code": 501, "message": "not implemented"}), False),
        (ValueError("Bad Request: invalid argument"), False),
        (StoreError("permanent"), False),
    ],
)
def test_is_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


class Flaky:
    """Fails with ``error`` the first ``failures`` calls, then returns ``"done"``."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def test_transient_errors_are_retried_with_jittered_exponential_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    waits: list[float] = []
    policy = RetryPolicy(
        attempts=6, deadline_s=600, initial_wait_s=0.2, max_wait_s=1.0, sleep=waits.append
    )
    step = Flaky(4, ConnectionResetError("reset"))
    with caplog.at_level(logging.WARNING, logger="deltastore.storage"):
        assert policy.call("reading x", step) == "done"
    assert step.calls == 5
    assert len(waits) == 4
    for attempt, wait in enumerate(waits, start=1):
        assert 0 <= wait <= min(1.0, 0.2 * 2 ** (attempt - 1))
    assert sum("reading x failed (attempt" in r.message for r in caplog.records) == 4


def test_retries_stop_after_the_attempts(caplog: pytest.LogCaptureFixture) -> None:
    waits: list[float] = []
    step = Flaky(100, TimeoutError("timed out"))
    with caplog.at_level(logging.ERROR, logger="deltastore.storage"), pytest.raises(TimeoutError):
        RetryPolicy(attempts=3, sleep=waits.append).call("listing y", step)
    assert step.calls == 3
    assert len(waits) == 2
    assert any("giving up after 3 attempt" in r.message for r in caplog.records)


def test_retries_stop_at_the_deadline() -> None:
    def slow_failure() -> None:
        time.sleep(0.05)
        raise ConnectionResetError("reset")

    calls: list[float] = []

    def step() -> None:
        calls.append(time.monotonic())
        slow_failure()

    with pytest.raises(ConnectionResetError):
        RetryPolicy(attempts=1000, deadline_s=0.2, initial_wait_s=0.001, max_wait_s=0.01).call(
            "z", step
        )
    assert 1 < len(calls) < 1000
    # No try starts after the deadline (slack only for a loaded machine's late wake-ups).
    assert calls[-1] - calls[0] < 0.2 + 1.0


@pytest.mark.parametrize(
    "error",
    [PermissionError("denied"), FileNotFoundError("gone"), ValueError("malformed")],
)
def test_permanent_errors_fail_at_once(error: Exception) -> None:
    waits: list[float] = []
    step = Flaky(1, error)
    with pytest.raises(type(error)):
        RetryPolicy(attempts=5, sleep=waits.append).call("w", step)
    assert step.calls == 1
    assert waits == []
