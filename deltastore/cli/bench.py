"""``deltastore bench``: delta sync against full-checkpoint sync, measured in one process.

Both are run on the same synthetic model and training steps, in the same process, so the
printed ratios hold on a noisy machine even where the absolute seconds do not.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    parse_storage_options,
    print_json,
    step_progress,
)
from deltastore.cli.demo import SyntheticTraining
from deltastore.codecs import CHECKSUMS, ENCODINGS
from deltastore.publish import DeltaPublisher
from deltastore.pull import pull_weights
from deltastore.storage import VersionStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure delta sync against full-checkpoint sync (ratios, same process)",
        description=(
            "Publish and pull the same synthetic training steps as deltas and as full "
            "checkpoints, and print wire bytes and seconds of each with their ratios."
        ),
    )
    p.add_argument("--size", type=float, default=256, help="model size in MB (default 256)")
    p.add_argument("--steps", type=int, default=3, help="steps measured (default 3)")
    p.add_argument("--lr", type=float, default=2e-7, help="per-element step (see demo)")
    p.add_argument("--encoding", default="xor", choices=sorted(ENCODINGS))
    p.add_argument("--checksum", default="xxh3-128", choices=sorted(CHECKSUMS))
    p.add_argument("--store", default=None, help="store URL prefix (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    options = parse_storage_options(args.storage_option)
    with tempfile.TemporaryDirectory(prefix="deltastore-bench-") as workdir:
        base = os.path.join(workdir, "base")
        os.makedirs(base)
        training = SyntheticTraining(args.size, args.seed)
        save_file(training.model, os.path.join(base, "model.safetensors"))
        total = training.total_bytes
        root = args.store or workdir
        modes = {"delta": False, "full": True}
        publishers = {}
        for mode in modes:
            store = VersionStore(f"{root.rstrip('/')}/store-{mode}", options)
            publishers[mode] = DeltaPublisher(
                store, base, encoding=args.encoding, checksum=args.checksum
            )
            publishers[mode].seed()
            pull_weights(os.path.join(workdir, f"host-{mode}"), store, 0, base_dir=base)
        sums = {mode: {"wire": 0.0, "publish": 0.0, "pull": 0.0} for mode in modes}
        with step_progress(args, "publish + pull, delta and full", args.steps) as advance:
            for _ in range(args.steps):
                _measure_step(args, training, publishers, modes, sums, workdir, base)
                advance()
    per_step = {mode: {k: v / args.steps for k, v in sums[mode].items()} for mode in modes}
    if args.json:
        print_json({"model_bytes": total, "steps": args.steps, "encoding": args.encoding,
                    "checksum": args.checksum, "per_step": per_step})  # fmt: skip
        return 0
    _print_table(args, total, per_step)
    return 0


def _measure_step(
    args: argparse.Namespace,
    training: SyntheticTraining,
    publishers: dict[str, DeltaPublisher],
    modes: dict[str, bool],
    sums: dict[str, dict[str, float]],
    workdir: str,
    base: str,
) -> None:
    """One training step, published and pulled as a delta and as a full checkpoint."""
    training.step(args.lr)
    for mode, full in modes.items():
        publisher = publishers[mode]
        t0 = time.perf_counter()
        result = publisher.publish(training.model.items(), full=full)
        t1 = time.perf_counter()
        host = os.path.join(workdir, f"host-{mode}")
        pull_weights(host, publisher.store, result.version, base_dir=base)
        t2 = time.perf_counter()
        sums[mode]["wire"] += result.wire_bytes
        sums[mode]["publish"] += t1 - t0
        sums[mode]["pull"] += t2 - t1


def _print_table(
    args: argparse.Namespace, total: int, per_step: dict[str, dict[str, float]]
) -> None:
    print(f"model {total / 1e6:.1f} MB bf16, {args.steps} steps, {args.encoding} + {args.checksum}")
    print(f"{'per step':<12}{'delta':>12}{'full':>12}{'delta/full':>12}")
    for key, unit, scale in (("wire", "MB", 1e6), ("publish", "s", 1.0), ("pull", "s", 1.0)):
        delta, full = per_step["delta"][key], per_step["full"][key]
        print(
            f"{key + ' ' + unit:<12}{delta / scale:>12.3f}{full / scale:>12.3f}"
            f"{(delta / full if full else float('nan')):>12.4f}"
        )
