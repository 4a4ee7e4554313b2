"""Load and soak: many host processes pull while a trainer publishes, through a faulty proxy.

One moto S3 server runs in this process behind a :class:`~deltastore.testing.faults.FaultProxy`
that answers a share of requests with a 5xx error, drops the response after forwarding (a lost
acknowledgement), or stalls and hangs up. A trainer process publishes ``versions`` consecutive
versions of a small synthetic bf16 model with anchors, pruning every few versions with a short
grace period; ``hosts`` host processes each seed a local checkpoint from the base and pull the
latest version until they hold the last one, verifying every version they claim (see
:mod:`tests.soak.soak_roles`).

Run it as ``python -m tests.soak.soak --hosts 8 --versions 200 --json``; it prints one
JSON summary and exits 1 when the run failed. :func:`run_soak` is the same from Python.

A run fails when a process crashed or timed out, a host met an error other than a version pruned
while it read it or a store step whose retries ran out (both retried by pulling again), or a host
claimed a version whose bytes did not verify. A claimed version is checked twice: by
:func:`deltastore.verify_local` against the store's digests (unless the version was pruned
between the pull and the check, which is counted) and against the trainer's own hashes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from deltastore.testing.faults import Fault, FaultProxy, s3_error
from deltastore.testing.servers import S3Server, start_moto_s3
from tests.soak.soak_roles import (
    HostJob,
    TrainerJob,
    host_main,
    report_path,
    trainer_main,
)

__all__ = ["SoakConfig", "SoakReport", "main", "run_soak"]

_JOIN_GRACE_S = 30.0
_SEED_TIMEOUT_S = 120.0
_STATUS_FAULTS = (("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503))


@dataclass(frozen=True)
class SoakConfig:
    """The shape of one soak run."""

    hosts: int = 8
    versions: int = 200
    size_mb: float = 4.0
    """Size of the synthetic bf16 model, MB (about 3 MB at least)."""
    anchor_every: int = 10
    """A full version every this many versions."""
    prune_every: int = 5
    """The trainer prunes after every this many versions..."""
    keep: int = 4
    """... keeping the newest ``keep`` versions (and their chains) ..."""
    grace_s: float = 0.5
    """... and deleting the data of versions unpublished more than this many seconds ago."""
    fault_share: float = 0.05
    """Share of the proxy's requests that get a fault (0 to 1)."""
    stall_s: float = 0.5
    """How long a stalled request is held before the proxy hangs up, seconds."""
    trainer_faults: bool = True
    """Send the trainer's requests through the faulty proxy too (else straight to moto)."""
    workers: int = 2
    """Threads per host for pull and verify."""
    lr: float = 2e-7
    """Per-element optimizer step of the synthetic training (~0.4 % of bytes change)."""
    seed: int = 0
    deadline_s: float = 900.0
    """A host that does not hold the last version after this many seconds fails the run."""


@dataclass(frozen=True)
class SoakReport:
    """What a run measured. ``problems`` is empty exactly when the run passed."""

    config: dict[str, Any]
    machine: dict[str, Any]
    wall_s: float
    trainer: dict[str, Any]
    hosts: list[dict[str, Any]]
    proxy: dict[str, Any]
    summary: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _FaultArmer:
    """Keeps one fault armed on ``proxy`` while fewer than ``share`` of its requests got one.

    FaultProxy rules apply to the next matching requests; arming one at a time, as requests
    arrive, spreads faults over the whole run and over every kind of request.
    """

    def __init__(self, proxy: FaultProxy, share: float, stall_s: float, seed: int) -> None:
        self.proxy = proxy
        self.share = share
        self.stall_s = stall_s
        self._rng = random.Random(seed)
        self._armed: Fault | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-armer", daemon=True)

    def _next_fault(self) -> Fault:
        action = self._rng.choice(("status", "drop-response", "stall"))
        if action == "status":
            code, status = self._rng.choice(_STATUS_FAULTS)
            return Fault("status", status=status, body=s3_error(code))
        return Fault(action, stall_s=self.stall_s)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            if self._armed is not None and self._armed.times > 0:
                continue
            if len(self.proxy.injected) < self.share * self.proxy.requests:
                self.proxy.clear()  # spent rules would otherwise be scanned on every request
                self._armed = self.proxy.add(self._next_fault())

    def __enter__(self) -> _FaultArmer:
        if self.share > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.proxy.clear()


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": load,
    }


def _start(ctx: Any, target: Any, job: Any, name: str) -> Any:
    process = ctx.Process(target=target, args=(job,), name=name, daemon=False)
    process.start()
    return process


def _wait_for(path: str, process: Any, timeout_s: float) -> bool:
    """Whether ``path`` appeared before ``process`` ended and within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not process.is_alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run_processes(
    config: SoakConfig, workdir: str, url: str, direct: dict[str, Any], proxied: dict[str, Any]
) -> None:
    """Start the trainer, then (once it seeded) the hosts; wait for all of them."""
    ctx = mp.get_context("spawn")
    trainer = _start(
        ctx,
        trainer_main,
        TrainerJob(
            url,
            proxied if config.trainer_faults else direct,
            workdir,
            config.versions,
            config.size_mb,
            config.anchor_every,
            config.prune_every,
            config.keep,
            config.grace_s,
            config.lr,
            config.seed,
        ),
        "soak-trainer",
    )
    processes = [trainer]
    try:
        # A trainer that fails to seed reports why; the hosts, never started, report nothing.
        seeded = _wait_for(report_path(workdir, "seeded"), trainer, _SEED_TIMEOUT_S)
        for host in range(config.hosts if seeded else 0):
            job = HostJob(
                host, url, proxied, workdir, config.versions, config.workers, config.deadline_s
            )
            processes.append(_start(ctx, host_main, job, f"soak-host{host}"))
        deadline = time.monotonic() + config.deadline_s + _JOIN_GRACE_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()


def _read_report(workdir: str, role: str) -> dict[str, Any] | None:
    try:
        with open(report_path(workdir, role)) as fh:
            report: dict[str, Any] = json.load(fh)
    except FileNotFoundError:
        return None
    return report


def _host_problems(host: dict[str, Any], versions: int) -> list[str]:
    """Why one host's report fails the run (empty when it passed)."""
    name = f"host {host['host']}"
    problems = []
    if host["error"]:
        problems.append(f"{name}: {host['error']}")
    claimed = host["claimed"]
    if not claimed or claimed[-1] != versions:
        problems.append(f"{name}: last claimed {claimed[-1:]} is not v{versions:06d}")
    if sorted(claimed) != claimed:
        problems.append(f"{name}: claimed versions went backwards: {claimed}")
    if host["verified_by_truth"] != claimed:
        problems.append(f"{name}: claimed {claimed} but only {host['verified_by_truth']} verified")
    unchecked = set(claimed) - set(host["verified_by_store"]) - set(host["pruned_before_verify"])
    if unchecked:
        problems.append(f"{name}: verify_local never passed for {sorted(unchecked)}")
    return problems


def _summarize(trainer: dict[str, Any], hosts: list[dict[str, Any]]) -> dict[str, Any]:
    mb_per_s = [h["bytes_read"] / 1e6 / h["pull_s"] for h in hosts if h["pull_s"] > 0]
    retries: Counter[str] = Counter(trainer.get("retries", {}))
    for host in hosts:
        retries.update(host["retries"])
    return {
        "versions_per_s_published": round(trainer.get("versions_per_s", 0.0), 3),
        "host_mb_per_s_in_pull": [round(x, 2) for x in mb_per_s],
        "host_mean_pull_s": [round(h["pull_s"] / max(1, len(h["claimed"])), 2) for h in hosts],
        "host_versions_claimed": [len(h["claimed"]) for h in hosts],
        "host_peak_rss_mb": [round(h["peak_rss_mb"], 1) for h in hosts],
        "trainer_peak_rss_mb": round(trainer.get("peak_rss_mb", 0.0), 1),
        "retries": dict(retries),
        "host_retried_errors": dict(sum((Counter(h["retried_errors"]) for h in hosts), Counter())),
        "pruned_before_verify": sum(len(h["pruned_before_verify"]) for h in hosts),
        "claims_verified": all(h["verified_by_truth"] == h["claimed"] for h in hosts),
    }


def _report(config: SoakConfig, workdir: str, proxy: FaultProxy, wall_s: float) -> SoakReport:
    trainer = _read_report(workdir, "trainer") or {"error": "the trainer wrote no report"}
    hosts, problems = [], []
    if trainer.get("error"):
        problems.append(f"trainer: {trainer['error']}")
    for host in range(config.hosts):
        report = _read_report(workdir, f"host{host}")
        if report is None:
            problems.append(f"host {host}: no report (crashed, killed or never started)")
            continue
        hosts.append(report)
        problems.extend(_host_problems(report, config.versions))
    injected = Counter(f.action for f in proxy.injected)
    return SoakReport(
        config=asdict(config),
        machine=_machine(),
        wall_s=round(wall_s, 2),
        trainer=trainer,
        hosts=hosts,
        proxy={"requests": proxy.requests, "faults": dict(injected)},
        summary=_summarize(trainer, hosts),
        problems=problems,
    )


def run_soak(config: SoakConfig, workdir: str | None = None) -> SoakReport:
    """Run one soak (see the module docstring) and report; never raises for a failed run:
    read :attr:`SoakReport.problems`. ``workdir`` keeps the files (else a temp dir)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deltastore-soak-") as tmp:
        work = workdir or tmp
        server: S3Server = start_moto_s3()
        bucket = f"soak-{uuid.uuid4().hex[:12]}"
        try:
            server.make_bucket(bucket)
            with FaultProxy(server.endpoint_url) as proxy:
                proxied = proxy.storage_options(server.storage_options)
                with _FaultArmer(proxy, config.fault_share, config.stall_s, config.seed):
                    _run_processes(
                        config, work, f"s3://{bucket}/run", server.storage_options, proxied
                    )
                return _report(config, work, proxy, time.perf_counter() - started)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.soak.soak``: run a soak, print the summary; exit 1 on failure."""
    defaults = SoakConfig()
    p = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__)
    for name in ("hosts", "versions", "anchor_every", "prune_every", "keep", "workers", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("size_mb", "grace_s", "fault_share", "stall_s", "deadline_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    p.add_argument("--no-trainer-faults", action="store_true", help="trainer goes straight to S3")
    p.add_argument("--workdir", default=None, help="keep the run's files here")
    p.add_argument("--json", action="store_true", help="print the full report as one JSON object")
    args = p.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k in SoakConfig.__dataclass_fields__}
    config = SoakConfig(**options, trainer_faults=not args.no_trainer_faults)
    report = run_soak(config, args.workdir)
    if args.json:
        print(json.dumps({"ok": report.ok, **asdict(report)}))
    else:
        print(
            json.dumps({"ok": report.ok, **report.summary, "problems": report.problems}, indent=2)
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
