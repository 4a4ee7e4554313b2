"""What ``deltastore serve`` reports at ``GET /metrics``, in the Prometheus text format.

One :class:`PullMetrics` per server, with its own registry (two servers in one process, as in
the tests, never share counters). Every pull the server runs is counted once, by outcome:
``noop``, ``applied``, ``reseeded``, ``repaired`` or ``failed``. The names, with their
``deltastore_`` prefix dropped, are the keys a trainer reads from ``pop_metrics()`` where the
quantity exists there (``wire_bytes``, the phase seconds).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltastore.errors import DeltastoreError
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.result import PullResult

PHASE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of the phase histograms: a no-op pull to a slow reseed."""


class PullMetrics:
    """Counters, histograms and gauges of the pulls one server ran."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pulls = Counter("deltastore_pulls", "Pulls run, by outcome.", ["outcome"], registry=r)
        self.wire_bytes = Counter(
            "deltastore_pull_wire_bytes", "Bytes read from the store by pulls.", registry=r
        )
        self.reconstructed_bytes = Counter(
            "deltastore_pull_reconstructed_bytes",
            "Bytes of local tensors written by pulls (patched, restored, reseeded).",
            registry=r,
        )
        self.tensors_applied = Counter(
            "deltastore_pull_tensors_applied", "Local tensors written by pulls.", registry=r
        )
        self.tensors_skipped = Counter(
            "deltastore_pull_tensors_skipped",
            "Local tensors pulls left as they were (unchanged).",
            registry=r,
        )
        self.reseeds = Counter(
            "deltastore_pull_reseeds", "Pulls that reseeded the local checkpoint.", registry=r
        )
        self.phase_seconds = Histogram(
            "deltastore_pull_phase_seconds",
            "Seconds per pull phase (prepare, reseed, apply, total).",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.version = Gauge(
            "deltastore_checkpoint_version",
            "The verified version each local checkpoint holds.",
            ["local_checkpoint_dir"],
            registry=r,
        )
        for outcome in ("noop", "applied", "reseeded", "repaired", "failed"):
            self.pulls.labels(outcome)  # every outcome shows from the start, at 0

    def pulled(self, local_dir: str, result: PullResult) -> None:
        """Count a pull that succeeded."""
        self.pulls.labels(result.action).inc()
        self.wire_bytes.inc(result.bytes_read)
        self.reconstructed_bytes.inc(result.bytes_reconstructed)
        self.tensors_applied.inc(result.tensors_applied)
        self.tensors_skipped.inc(result.tensors_skipped)
        self.reseeds.inc(result.reseeds)
        for phase, seconds in result.phase_seconds.items():
            self.phase_seconds.labels(phase).observe(seconds)
        self.phase_seconds.labels("total").observe(result.seconds)
        self.version.labels(local_dir).set(result.version)

    def failed(self, local_dir: str) -> None:
        """Count a pull that failed; the gauge shows what the local dir holds after it (a
        failed pull keeps or puts back its verified version; no state: the gauge goes)."""
        self.pulls.labels("failed").inc()
        try:
            state = LocalCheckpoint(local_dir).read_state()
        except (DeltastoreError, OSError):
            state = None
        if state is not None:
            self.version.labels(local_dir).set(state.version)
        else:
            try:
                self.version.remove(local_dir)
            except KeyError:
                pass

    def exposition(self) -> bytes:
        """The text format of every metric (the body of ``GET /metrics``)."""
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "PHASE_BUCKETS", "PullMetrics"]
