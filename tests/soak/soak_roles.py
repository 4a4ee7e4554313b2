"""The two roles of the load and soak run (:mod:`tests.soak.soak`), one process each.

:func:`trainer_main` trains a small synthetic bf16 model, publishes one version per step with
anchors, and prunes every few versions. :func:`host_main` seeds a local checkpoint from the base,
then loops (refresh, pull the latest version, verify it) until it holds the trainer's last
version. Both use only the public API and write a JSON report into the run's directory, so a
crashed process is seen as a missing report, not as a hang.

Besides :func:`deltastore.verify_local` (which checks a checkpoint against the digests the store
publishes), each host checks every version it claims against *ground truth*: the trainer writes
a hash of every tensor's bytes for version ``n`` before it publishes ``n``, and the host hashes
its own files. A store that served wrong digests together with wrong bytes would pass the first
check, never the second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import struct
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import deltastore as ds
from deltastore.errors import TransientStoreError
from deltastore.storage import RetryPolicy
from deltastore.storage.durable import atomic_replace

__all__ = ["HostJob", "RetryCounter", "TrainerJob", "host_main", "trainer_main"]

# Errors a host may meet under faults and pruning, then retry: a version pruned while it was
# read (the pull re-resolves once, then says which version to pull instead), and a store step
# whose retries ran out under injected faults. Anything else (IntegrityError above all) ends the
# host and fails the run.
_RETRIED_ERRORS = (ds.VersionNotFoundError, TransientStoreError)
# A host with nothing new waits this long before listing again: every poll is a LIST through
# the proxy, and eight hosts polling faster load the server more than the pulls do.
_POLL_S = 0.2
_VERIFY_ATTEMPTS = 3


@dataclass(frozen=True)
class TrainerJob:
    """What the trainer process does (plain values: it crosses a process boundary)."""

    store_url: str
    storage_options: dict[str, Any]
    workdir: str
    versions: int
    size_mb: float
    anchor_every: int
    prune_every: int
    keep: int
    grace_s: float
    lr: float
    seed: int


@dataclass(frozen=True)
class HostJob:
    """What one host process does."""

    host: int
    store_url: str
    storage_options: dict[str, Any]
    workdir: str
    versions: int
    workers: int
    deadline_s: float


def base_dir(workdir: str) -> str:
    """The base checkpoint (version 0) every host seeds from."""
    return os.path.join(workdir, "base")


def truth_path(workdir: str, version: int) -> str:
    """The trainer's hashes of every tensor of ``version`` (written before it is published)."""
    return os.path.join(workdir, "truth", f"v{version:06d}.json")


def report_path(workdir: str, role: str) -> str:
    return os.path.join(workdir, "reports", f"{role}.json")


def _write_json(path: str, value: Any) -> None:
    """Write ``value`` as JSON atomically (temp + rename): readers never see half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_replace(path, json.dumps(value).encode())


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class RetryCounter(logging.Handler):
    """Counts the retries that the layers under a store log, and the warnings deltastore logs.

    ``deltastore`` counts the waits of deltastore's own :class:`RetryPolicy` (its injectable
    sleep, so the count is exact). The others are read from debug logs: ``botocore`` counts
    "Retry needed" decisions of botocore's retry handler, ``s3fs`` the retryable errors s3fs
    retries itself; ``warnings`` counts WARNING records of the ``deltastore`` loggers (a retry,
    a version pruned mid-pull).
    """

    _SOURCES = {
        "botocore.retryhandler": "botocore",
        "botocore.retries.standard": "botocore",
        "s3fs": "s3fs",
    }

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[str] = Counter()

    def install(self) -> None:
        for name in self._SOURCES:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(self)
        logging.getLogger("deltastore").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        source = self._SOURCES.get(record.name)
        if source == "botocore" and message.startswith("Retry needed") and "quota" not in message:
            self.counts["botocore"] += 1
        elif source == "s3fs" and (
            message.startswith("Retryable error")
            # s3fs logs every client error so (a 404 too) but retries only throttling
            or (message.startswith("Client error") and "SlowDown" in record.getMessage())
        ):
            self.counts["s3fs"] += 1
        elif record.name.startswith("deltastore") and record.levelno >= logging.WARNING:
            self.counts["warnings"] += 1

    def policy(self) -> RetryPolicy:
        """deltastore's default retry policy, counting each wait in ``counts["deltastore"]``."""

        def sleep(seconds: float) -> None:
            self.counts["deltastore"] += 1
            time.sleep(seconds)

        return RetryPolicy(sleep=sleep)


# --------------------------------------------------------------------------- ground truth
def _safetensors_tensors(path: Path) -> Iterator[tuple[str, int, int]]:
    """(name, start, end) of every tensor in a safetensors file; offsets from the file start."""
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            yield name, 8 + header_len + start, 8 + header_len + end


def hash_checkpoint(directory: str) -> dict[str, str]:
    """BLAKE2b of every tensor's bytes in the ``*.safetensors`` files of ``directory``."""
    hashes: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as fh:
            data = fh.read()
        view = memoryview(data)
        for name, start, end in _safetensors_tensors(path):
            hashes[name] = hashlib.blake2b(view[start:end], digest_size=16).hexdigest()
    return hashes


def hash_tensors(tensors: dict[str, Any]) -> dict[str, str]:
    """BLAKE2b of every torch tensor's bytes (as a safetensors file would hold them)."""
    import torch

    return {
        name: hashlib.blake2b(
            tensor.contiguous().view(torch.uint8).numpy(), digest_size=16
        ).hexdigest()
        for name, tensor in tensors.items()
    }


# --------------------------------------------------------------------------- trainer
def small_layout(size_mb: float) -> list[tuple[str, tuple[int, int]]]:
    """A transformer-like layout of bf16 tensors adding up to about ``size_mb`` MB (≥ ~3 MB)."""
    hidden, mlp, vocab = 256, 704, 2048
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * mlp)
    layers = max(1, round((size_mb * 1e6 - 4 * vocab * hidden) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((f"{prefix}.self_attn.{proj}.weight", (hidden, hidden)))
        shapes.append((f"{prefix}.mlp.gate_proj.weight", (mlp, hidden)))
        shapes.append((f"{prefix}.mlp.up_proj.weight", (mlp, hidden)))
        shapes.append((f"{prefix}.mlp.down_proj.weight", (hidden, mlp)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


@dataclass
class _TrainerTally:
    publish_s: float = 0.0
    prune_s: float = 0.0
    wire_bytes: int = 0
    full_versions: list[int] = field(default_factory=list)
    publish_failures: list[str] = field(default_factory=list)
    unpublished: int = 0
    deleted: int = 0


def _publish_with_retry(publisher: Any, model: dict[str, Any], tally: _TrainerTally) -> Any:
    """Publish; a failed publish commits nothing and keeps its number, so it is tried again."""
    for attempt in range(5):
        try:
            return publisher.publish(model.items())
        except ds.PublishError as exc:
            tally.publish_failures.append(f"{type(exc).__name__}: {exc}")
            if attempt == 4:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def _train_and_publish(job: TrainerJob, counter: RetryCounter) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    # One intra-op thread: the step is small, and on a shared machine spinning pool threads
    # cost more than they give.
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(job.seed)
    master = {
        name: torch.randn(shape, generator=generator) * 0.02
        for name, shape in small_layout(job.size_mb)
    }
    model = {name: w.to(torch.bfloat16) for name, w in master.items()}
    os.makedirs(base_dir(job.workdir), exist_ok=True)
    save_file(model, os.path.join(base_dir(job.workdir), "model.safetensors"))
    store = ds.VersionStore(job.store_url, job.storage_options, retry=counter.policy())
    publisher = ds.DeltaPublisher(
        store, base_dir(job.workdir), anchor_every=job.anchor_every, workers=2
    )
    publisher.seed()
    _write_json(report_path(job.workdir, "seeded"), {"pid": os.getpid()})
    tally = _TrainerTally()
    started = time.perf_counter()
    for version in range(1, job.versions + 1):
        # The fp32 master weights take a ±lr step; the bf16 model changes only where the
        # rounding flips, which is what makes RL deltas sparse.
        for name, weight in master.items():
            weight.add_(torch.randn(weight.shape, generator=generator).sign_() * job.lr)
            model[name] = weight.to(torch.bfloat16)
        _write_json(truth_path(job.workdir, version), hash_tensors(model))
        t0 = time.perf_counter()
        result = _publish_with_retry(publisher, model, tally)
        tally.publish_s += time.perf_counter() - t0
        if result.version != version:
            raise AssertionError(f"published v{result.version:06d}, expected v{version:06d}")
        tally.wire_bytes += result.wire_bytes
        if result.kind == "full":
            tally.full_versions.append(version)
        if version % job.prune_every == 0:
            t0 = time.perf_counter()
            report = store.prune(keep=job.keep, grace_s=job.grace_s)
            tally.prune_s += time.perf_counter() - t0
            tally.unpublished += len(report.unpublish)
            tally.deleted += len(report.delete)
    wall_s = time.perf_counter() - started
    return {
        "versions": job.versions,
        "model_mb": sum(t.numel() * 2 for t in model.values()) / 1e6,
        "tensors": len(model),
        "wall_s": wall_s,
        "versions_per_s": job.versions / wall_s,
        **asdict(tally),
    }


def trainer_main(job: TrainerJob) -> None:
    """Entry point of the trainer process; writes ``reports/trainer.json``."""
    counter = RetryCounter()
    counter.install()
    report: dict[str, Any] = {"error": None}
    try:
        report.update(_train_and_publish(job, counter))
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        report["retries"] = dict(counter.counts)
        report["peak_rss_mb"] = peak_rss_mb()
        _write_json(report_path(job.workdir, "trainer"), report)


# --------------------------------------------------------------------------- host
@dataclass
class _HostTally:
    claimed: list[int] = field(default_factory=list)
    verified_by_store: list[int] = field(default_factory=list)
    verified_by_truth: list[int] = field(default_factory=list)
    pruned_before_verify: list[int] = field(default_factory=list)
    retried_errors: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0
    pull_s: float = 0.0


def _host_fields(tally: _HostTally) -> dict[str, Any]:
    """The tally as JSON values (``asdict`` would rebuild each Counter from its pairs)."""
    fields = {name: getattr(tally, name) for name in tally.__dataclass_fields__}
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in fields.items()}


def _check_truth(job: HostJob, local: str, version: int) -> None:
    with open(truth_path(job.workdir, version)) as fh:
        expected = json.load(fh)
    actual = hash_checkpoint(local)
    if actual != expected:
        wrong = sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))
        raise ds.IntegrityError(
            f"host {job.host}: {local} claims v{version:06d} but tensors {wrong[:5]} differ from "
            "what the trainer published"
        )


def _pull_and_verify(job: HostJob, store: Any, local: str, target: int, tally: _HostTally) -> None:
    """Pull ``target`` (or fail with a retried error), then verify what the pull claims."""
    base = base_dir(job.workdir)
    t0 = time.perf_counter()
    result = ds.pull_weights(local, store, target, base_dir=base, workers=job.workers)
    tally.pull_s += time.perf_counter() - t0
    tally.bytes_read += result.bytes_read
    tally.actions[result.action] += 1
    tally.claimed.append(result.version)
    _check_truth(job, local, result.version)
    tally.verified_by_truth.append(result.version)
    _verify_claim(job, store, local, result.version, tally)


def _verify_claim(job: HostJob, store: Any, local: str, version: int, tally: _HostTally) -> None:
    """``verify_local`` on a claimed version; a store step whose retries ran out under the
    injected faults is tried again (a few times), a version pruned meanwhile is counted."""
    for attempt in range(_VERIFY_ATTEMPTS):
        try:
            ds.verify_local(
                local, store, version, base_dir=base_dir(job.workdir), workers=job.workers
            )
        except TransientStoreError:
            tally.retried_errors["TransientStoreError in verify_local"] += 1
            if attempt == _VERIFY_ATTEMPTS - 1:
                raise
        except ds.VersionNotFoundError:
            store.refresh()
            if version in store.versions():
                raise  # still published: the store failed to read it, not pruning
            tally.pruned_before_verify.append(version)
            return
        else:
            tally.verified_by_store.append(version)
            return


def _pull_until_last(job: HostJob, counter: RetryCounter, tally: _HostTally) -> None:
    store = ds.VersionStore(job.store_url, job.storage_options, retry=counter.policy())
    local = os.path.join(job.workdir, f"host{job.host}")
    ds.pull_weights(local, store, 0, base_dir=base_dir(job.workdir), workers=job.workers)
    deadline = time.monotonic() + job.deadline_s
    held = 0
    while held < job.versions:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"host {job.host} holds v{held:06d} after {job.deadline_s:.0f} s; the trainer's "
                f"last version is v{job.versions:06d}"
            )
        store.refresh()
        latest = store.latest()
        if latest <= held:
            time.sleep(_POLL_S)
            continue
        try:
            _pull_and_verify(job, store, local, latest, tally)
        except _RETRIED_ERRORS as exc:
            tally.retried_errors[type(exc).__name__] += 1
            continue
        held = tally.claimed[-1]


def host_main(job: HostJob) -> None:
    """Entry point of host process ``job.host``; writes ``reports/host<N>.json``."""
    counter = RetryCounter()
    counter.install()
    tally = _HostTally()
    report: dict[str, Any] = {"host": job.host, "error": None}
    started = time.perf_counter()
    try:
        _pull_until_last(job, counter, tally)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"host {job.host}: {report['error']}", file=sys.stderr)
    finally:
        report.update(_host_fields(tally))
        report["wall_s"] = time.perf_counter() - started
        report["retries"] = dict(counter.counts)
        report["peak_rss_mb"] = peak_rss_mb()
        _write_json(report_path(job.workdir, f"host{job.host}"), report)
