"""What ``deltastore bench`` prints: one JSON object (``--json``) or tables, and the targets."""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any

import numpy as np
import torch

from deltastore.cli.bench_measure import Bench, Path
from deltastore.publish.device import host_bytes

BIG_MODEL_BYTES = 512 * 10**6
"""From this size the publish target is half the reference-style time; below it, parity."""
WIRE_TARGET = 0.55
PULL_TARGET = 1.2


def _changed_bytes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    return sum(
        int(np.count_nonzero(host_bytes(n, before[n]) != host_bytes(n, after[n]))) for n in before
    )


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _path_figures(
    path: Path, ref: Path, upstream: Path, full: Path, model_bytes: int
) -> dict[str, Any]:
    return {
        "wire_bytes": path.wire_bytes,
        "wire_pct_of_full": round(100 * path.wire_bytes / model_bytes, 4),
        "wire_vs_reference": _ratio(path.wire_bytes, ref.wire_bytes),
        "publish_s": round(path.publish_s, 4),
        "publish_vs_reference": _ratio(path.publish_s, ref.publish_s),
        "publish_vs_full_copy": _ratio(path.publish_s, full.publish_s),
        "publish_gbps": _gbps(model_bytes, path.publish_s),
        "pull_s": round(path.pull_s, 4),
        "pull_vs_reference": _ratio(path.pull_s, ref.pull_s),
        "pull_vs_upstream": _ratio(path.pull_s, upstream.pull_s),
        "pull_vs_full_copy": _ratio(path.pull_s, full.pull_s),
        "pull_gbps": _gbps(model_bytes, path.pull_s),
        "phase_s": {k: round(v, 4) for k, v in path.phases.items()},
        "phase_gbps": {k.removesuffix("_s"): _gbps(model_bytes, v) for k, v in path.phases.items()},
    }


def _targets(
    kind: str, model_bytes: int, paths: dict[str, dict[str, Any]], own: str
) -> list[dict[str, Any]]:
    publish_target = (
        0.5 if model_bytes >= BIG_MODEL_BYTES and kind in ("synthetic", "checkpoint") else 1.0
    )
    wanted = (
        ("wire_vs_reference", WIRE_TARGET),
        ("publish_vs_reference", publish_target),
        ("pull_vs_reference", PULL_TARGET),
        ("pull_vs_upstream", PULL_TARGET),
    )
    return [
        {
            "target": name,
            "encoding": own,
            "at_most": limit,
            "measured": paths[own][name],
            "met": paths[own][name] is not None and paths[own][name] <= limit,
        }
        for name, limit in wanted
    ]


def report(
    args: argparse.Namespace,
    kind: str,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    bench: Bench,
    encodings: list[str],
    workers: int,
    repeat: int,
) -> dict[str, Any]:
    """The bench's one JSON object (see docs/benchmarks.md for each key)."""
    model_bytes = sum(t.numel() * t.element_size() for t in before.values())
    ref, upstream, full = bench.paths["reference"], bench.paths["upstream"], bench.paths["full"]
    paths = {
        name: _path_figures(bench.paths[name], ref, upstream, full, model_bytes)
        for name in ["reference", "upstream", *encodings]
    }
    own = "auto" if "auto" in encodings else encodings[-1]
    table = bench.paths[args.encoding or encodings[0]]
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "model": {
            "kind": kind,
            "bytes": model_bytes,
            "tensors": len(before),
            "density_bytes": round(_changed_bytes(before, after) / model_bytes, 6),
            "simulated_density": None if args.next else args.density,
        },
        "workers": workers,
        "repeat": repeat,
        "store": "s3 (moto)"
        if args.backend == "s3" and not args.store
        else (args.store or "local dir"),
        "full_copy_s": round(full.publish_s, 4),
        "paths": paths,
        "per_step": {  # the delta-vs-full table (--encoding): bytes and seconds
            "encoding": args.encoding or encodings[0],
            "delta": {"wire": table.wire_bytes, "publish": table.publish_s, "pull": table.pull_s},
            "full": {"wire": full.wire_bytes, "publish": full.publish_s, "pull": full.pull_s},
        },
        "targets": _targets(kind, model_bytes, paths, own),
    }


def print_tables(result: dict[str, Any], encoding: str) -> None:
    """The delta-vs-full table for ``encoding``, the side-by-side table and the targets."""
    model = result["model"]
    paths = result["paths"]
    print(
        f"model {model['kind']} {model['bytes'] / 1e6:.1f} MB, {model['tensors']} tensors, "
        f"{model['density_bytes']:.3%} of bytes changed; {result['workers']} threads, best of "
        f"{result['repeat']}; store {result['store']}"
    )
    delta = paths[encoding]
    full_s = result["full_copy_s"]
    print(f"{'per step':<12}{'delta':>12}{'full':>12}{'delta/full':>12}")
    for key, unit, scale, full in (
        ("wire", "MB", 1e6, model["bytes"]),
        ("publish", "s", 1.0, full_s),
        ("pull", "s", 1.0, full_s),
    ):
        value = delta["wire_bytes"] if key == "wire" else delta[f"{key}_s"]
        print(
            f"{key + ' ' + unit:<12}{value / scale:>12.3f}{full / scale:>12.3f}"
            f"{(value / full if full else float('nan')):>12.4f}"
        )
    print()
    print(
        f"{'path':<12}{'wire %':>10}{'wire/ref':>10}{'publish s':>11}{'pub/ref':>9}"
        f"{'pull s':>9}{'pull/ref':>10}{'pull/up':>9}"
    )
    for name, row in paths.items():
        print(
            f"{name:<12}{row['wire_pct_of_full']:>10.3f}{row['wire_vs_reference']:>10.3f}"
            f"{row['publish_s']:>11.3f}{row['publish_vs_reference']:>9.3f}{row['pull_s']:>9.3f}"
            f"{row['pull_vs_reference']:>10.3f}{row['pull_vs_upstream']:>9.3f}"
        )
    print()
    for target in result["targets"]:
        mark = "met" if target["met"] else "NOT met"
        print(
            f"target {target['target']} ({target['encoding']}) ≤ {target['at_most']}: "
            f"measured {target['measured']}, {mark}"
        )
