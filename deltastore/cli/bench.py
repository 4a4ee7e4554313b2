"""``deltastore bench``: deltastore side by side with a reference-style delta path and a
full-checkpoint copy, measured in one process on the same step.

Every ratio is taken in the same process, on the same bytes, with the same thread count, best
of ``--repeat`` runs interleaved, so the ratios hold on a noisy machine even where the absolute
seconds do not. docs/benchmarks.md has the figures and the commands that made them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    byte_progress,
    parse_storage_options,
    print_json,
)
from deltastore.codecs import ENCODINGS
from deltastore.errors import ConfigError
from deltastore.progress import ProgressCallback
from deltastore.publish.config import default_workers


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure deltastore against a reference-style delta path and a full copy",
        description=(
            "Publish and pull one training step with each encoding, with a reference-style "
            "XOR + zstd-1 writer/reader and as a full-checkpoint copy, in one process, and "
            "print wire bytes, seconds, GB/s per phase and the ratios (with --json: targets)."
        ),
    )
    p.add_argument(
        "--model",
        choices=("synthetic", "small", "moe"),
        default="synthetic",
        help="synthetic: few large tensors; small: hundreds of small ones; moe: "
        "--tensors experts of 64 KB (ignored with --checkpoint)",
    )
    p.add_argument("--size", type=float, default=256, help="synthetic model MB (default 256)")
    p.add_argument("--tensors", type=int, default=8000, help="moe experts (default 8000)")
    p.add_argument("--layers", type=int, default=24, help="small model layers (default 24)")
    p.add_argument("--checkpoint", default=None, help="real weights: a safetensors directory")
    p.add_argument(
        "--next",
        default=None,
        help="with --checkpoint: the next checkpoint (default: a simulated step)",
    )
    p.add_argument(
        "--density",
        type=float,
        default=0.004,
        help="simulated step: share of elements moved ±1 ulp (default 0.004)",
    )
    p.add_argument(
        "--encodings",
        default="xor,sparse-v2,auto",
        help="comma-separated encodings to measure (default xor,sparse-v2,auto)",
    )
    p.add_argument(
        "--encoding",
        default=None,
        choices=sorted(ENCODINGS),
        help="the encoding of the delta-vs-full table (default: the first measured)",
    )
    p.add_argument("--workers", type=int, default=None, help="threads, both sides (default: cores)")
    p.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    p.add_argument(
        "--steps", type=int, default=None, help=argparse.SUPPRESS
    )  # old name of --repeat
    p.add_argument("--store", default=None, help="store URL prefix (default: a temp dir)")
    p.add_argument(
        "--backend",
        choices=("local", "s3"),
        default="local",
        help="s3: sync through an embedded S3 server (moto) instead of a local dir",
    )
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def _models(args: argparse.Namespace) -> tuple[str, dict, dict]:  # type: ignore[type-arg]
    from deltastore.cli import bench_models as m

    if args.checkpoint:
        before = m.checkpoint_model(args.checkpoint)
        after = m.checkpoint_model(args.next) if args.next else None
        kind = "checkpoint"
    else:
        kind = args.model
        if kind == "synthetic":
            before = m.synthetic_model(args.size, args.seed)
        elif kind == "small":
            before = m.small_model(args.layers, args.seed)
        else:
            before = m.moe_model(args.tensors, args.seed)
        after = None
    return kind, before, after or m.simulated_step(before, args.density, args.seed + 1)


@contextlib.contextmanager
def _store_root(args: argparse.Namespace, workdir: str) -> Iterator[tuple[str, dict[str, object]]]:
    options = parse_storage_options(args.storage_option)
    if args.store:
        yield args.store, options
    elif args.backend == "s3":
        from deltastore.cli.emulate import running_emulator

        with running_emulator("s3", "deltastore-bench") as emulator:
            yield f"{emulator.url}/bench", {**emulator.storage_options, **options}
    else:
        yield workdir, options


def _runs_progress(
    progress: ProgressCallback | None,
    model: Mapping[str, Any],
    repeat: int,
    encodings: list[str],
) -> Callable[[], None]:
    """``advance()`` for each finished run of one path: the bar counts the model bytes synced,
    one model per run (the runs are measured without a callback, so it costs them nothing)."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    total = repeat * (len(encodings) + 2) * model_bytes
    done = 0
    if progress is not None:
        progress("runs", 0, total)

    def advance() -> None:
        nonlocal done
        done += model_bytes
        if progress is not None:
            progress("runs", done, total)

    return advance


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from deltastore.cli.bench_measure import Bench, run_all
    from deltastore.cli.bench_report import print_tables, report

    repeat = args.steps or args.repeat
    encodings = [e for e in args.encodings.split(",") if e]
    for name in encodings + ([args.encoding] if args.encoding else []):
        if name not in ENCODINGS:
            raise ConfigError(f"unknown encoding {name!r}; known: {', '.join(sorted(ENCODINGS))}")
    if args.encoding and args.encoding not in encodings:
        encodings.append(args.encoding)
    if repeat < 1 or not encodings:
        raise ConfigError("--repeat must be ≥ 1 and --encodings must name one at least")
    workers = args.workers or default_workers()
    kind, before, after = _models(args)
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="deltastore-bench-"))
        root, options = stack.enter_context(_store_root(args, workdir))
        base = os.path.join(workdir, "base")
        os.makedirs(base)
        save_file(
            {n: t.contiguous() for n, t in before.items()}, os.path.join(base, "model.safetensors")
        )
        bench = Bench(base, after, workdir, workers, root, options)
        what = f"bench {kind}: reference, {', '.join(encodings)}, full copy"
        with byte_progress(args, what) as progress:
            run_all(bench, encodings, repeat, _runs_progress(progress, before, repeat, encodings))
    result = report(args, kind, before, after, bench, encodings, workers, repeat)
    if args.json:
        print_json(result)
    else:
        print_tables(result, args.encoding or encodings[0])
    return 0
