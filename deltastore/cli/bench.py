"""``deltastore bench``: deltastore side by side with a reference-style delta path
(:mod:`deltastore.cli.reference`) and a full-checkpoint copy, measured on one model step.

Every ratio is taken in the same process, on the same bytes, with the same thread count, best
of ``--repeat`` runs interleaved, so the ratios hold on a noisy machine even where the absolute
seconds do not. The simulated step moves ``density`` of each floating tensor's elements by ±1
ulp at random positions (what an Adam step does to bf16 weights: nearly every change is one
rounding flip). docs/benchmarks.md has the figures and the commands that made them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deltastore.cli.common import Subparsers, add_command, byte_progress, print_json
from deltastore.cli.demo import backend_store, layer_shapes
from deltastore.cli.reference import reference_publish, reference_pull
from deltastore.codecs import ENCODINGS
from deltastore.errors import ConfigError
from deltastore.format.checkpoint import checkpoint_files, read_tensor, scan_checkpoint
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish import DeltaPublisher
from deltastore.publish.config import default_workers
from deltastore.publish.device import host_bytes
from deltastore.pull import pull_weights, wait_durable
from deltastore.storage import VersionStore

if TYPE_CHECKING:
    import torch

Model = dict[str, "torch.Tensor"]
PUBLISH_PHASES = ("load_s", "copy_s", "encode_s", "diff_s", "write_s", "commit_s")
"""Publisher metrics (``pop_metrics()``) reported per encoding; encode_s is summed over threads."""
BIG_MODEL_BYTES = 512 * 10**6
"""From this size the publish target is half the reference-style time; below it, parity."""
WIRE_TARGET = 0.55
PULL_TARGET = 1.2


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "bench",
        run,
        "measure deltastore against a reference-style delta path and a full copy",
        "Publish and pull one training step with each encoding, with a reference-style "
        "XOR + zstd-1 writer/reader and as a full-checkpoint copy, in one process, and "
        "print wire bytes, seconds, GB/s per phase and the ratios (with --json: targets).",
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
    p.add_argument("--checkpoint", help="real weights: a safetensors directory")
    p.add_argument("--next", help="with --checkpoint: the next one (default: a simulated step)")
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
        choices=sorted(ENCODINGS),
        help="the encoding of the delta-vs-full table (default: the first measured)",
    )
    p.add_argument("--workers", type=int, help="threads, both sides (default: cores)")
    p.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # old --repeat
    p.add_argument("--store", help="store URL prefix (default: a temp dir)")
    p.add_argument(
        "--backend",
        choices=("local", "s3"),
        default="local",
        help="s3: sync through an embedded S3 server (moto) instead of a local dir",
    )
    p.add_argument("--seed", type=int, default=0)


def _random_bf16(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> Model:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in shapes
    }


def small_model(layers: int, seed: int) -> Model:
    """A 256-wide transformer: 16 tensors per layer, most of them 0.5 KB to 512 KB."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (4096, 256))]
    for i in range(layers):
        p = f"layers.{i}"
        for proj in ("q", "k", "v", "o"):
            shapes += [(f"{p}.attn.{proj}.weight", (256, 256)), (f"{p}.attn.{proj}.bias", (256,))]
        shapes += [(f"{p}.mlp.up.weight", (1024, 256)), (f"{p}.mlp.up.bias", (1024,))]
        shapes += [(f"{p}.mlp.down.weight", (256, 1024)), (f"{p}.mlp.down.bias", (256,))]
        for norm in ("norm1", "norm2"):
            shapes += [(f"{p}.{norm}.weight", (256,)), (f"{p}.{norm}.bias", (256,))]
    return _random_bf16([*shapes, ("lm_head.weight", (4096, 256))], seed)


def moe_model(tensors: int, seed: int) -> Model:
    """``tensors`` expert tensors of 64 KB bf16 (32,768 elements each): 8,000 are 524 MB."""
    experts = _random_bf16([("experts", (tensors, 32768))], seed)["experts"]
    return {f"experts.{i}.weight": experts[i] for i in range(tensors)}


def checkpoint_model(directory: str) -> Model:
    """Every tensor of the checkpoint in ``directory``."""
    from safetensors.torch import load_file

    model: Model = {}
    for path in checkpoint_files(directory):
        model.update(load_file(path))
    return model


def simulated_step(model: Model, density: float, seed: int) -> Model:
    """A copy of ``model`` with ``density`` of each floating tensor's elements moved ±1 ulp."""
    import torch

    if not 0.0 <= density <= 1.0:
        raise ConfigError(f"--density must be between 0 and 1, got {density}")
    signed_views = {
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
        torch.float32: torch.int32,
        torch.float64: torch.int64,
    }
    rng = np.random.default_rng(seed)
    stepped: Model = {}
    for name, tensor in model.items():
        out = tensor.clone()
        signed = signed_views.get(out.dtype)
        if signed is not None and out.numel():
            flat = out.reshape(-1).view(signed).numpy()
            count = int(rng.binomial(flat.size, density))
            where = np.unique(rng.integers(0, flat.size, count))
            flat[where] += rng.choice(np.array([-1, 1], dtype=flat.dtype), where.size)
        stepped[name] = out
    return stepped


def _models(args: argparse.Namespace) -> tuple[str, Model, Model]:
    if args.checkpoint:
        kind, before = "checkpoint", checkpoint_model(args.checkpoint)
        after = checkpoint_model(args.next) if args.next else None
    else:
        kind, after = args.model, None
        if kind == "synthetic":  # the demo's layout: few, large tensors
            before = _random_bf16(list(layer_shapes(args.size)), args.seed)
        elif kind == "small":
            before = small_model(args.layers, args.seed)
        else:
            before = moe_model(args.tensors, args.seed)
    return kind, before, after or simulated_step(before, args.density, args.seed + 1)


def settle() -> None:
    """Flush dirty pages before a timed section, so no path pays for the previous one's writes."""
    if hasattr(os, "sync"):
        os.sync()


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()`` after :func:`settle`: its result and its seconds."""
    settle()
    begun = time.perf_counter()
    result = call()
    return result, time.perf_counter() - begun


@dataclass
class Path:
    """Best-of figures of one way to sync the step (seconds; bytes)."""

    wire_bytes: int = 0
    publish_s: float = float("inf")
    pull_s: float = float("inf")
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the fastest publish / pull."""

    def keep(
        self,
        wire_bytes: int,
        publish_s: float,
        pull_s: float,
        phases: dict[str, float] | None = None,
    ) -> None:
        self.wire_bytes = wire_bytes
        phases = phases or {}
        if publish_s < self.publish_s:
            self.phases = {**self.phases, **{k: v for k, v in phases.items() if "pull" not in k}}
        self.publish_s = min(self.publish_s, publish_s)
        if pull_s < self.pull_s:
            self.phases.update({k: v for k, v in phases.items() if "pull" in k})
        self.pull_s = min(self.pull_s, pull_s)


@dataclass
class Bench:
    """What one bench run measures: every path ``repeat`` times (:meth:`run_all`)."""

    base_dir: str
    after: Model
    workdir: str
    workers: int
    store_root: str
    storage_options: dict[str, object] = field(default_factory=dict)
    paths: defaultdict[str, Path] = field(default_factory=lambda: defaultdict(Path))
    runs: int = 0

    def measure_reference(self) -> None:
        """One reference-style publish and in-place pull (best kept)."""
        snapshot = {n: read_tensor(t, n) for n, t in scan_checkpoint(self.base_dir).items()}
        shard = os.path.join(self.workdir, "reference-delta.safetensors")
        news = [(n, host_bytes(n, t)) for n, t in self.after.items()]
        publish = functools.partial(reference_publish, snapshot, news, shard, self.workers)
        (wire, phases), publish_s = _timed(publish)
        del snapshot, publish
        (base_file,) = checkpoint_files(self.base_dir)[:1]
        host_file = os.path.join(self.workdir, "reference-host.safetensors")
        shutil.copyfile(base_file, host_file)
        pulled, pull_s = _timed(lambda: reference_pull(shard, host_file, self.workers))
        pull_phases = {f"pull_{k}": v for k, v in pulled.seconds.items()}
        self.paths["reference"].keep(wire, publish_s, pull_s, {**phases.seconds, **pull_phases})
        # The same pull without the final msync, as the upstream engine readers apply a
        # version (the engine reloads from the page cache).
        shutil.copyfile(base_file, host_file)
        _, upstream_s = _timed(lambda: reference_pull(shard, host_file, self.workers, flush=False))
        self.paths["upstream"].keep(wire, publish_s, upstream_s)

    def measure_deltastore(self, encoding: str) -> None:
        """Seed a fresh store, publish the step with ``encoding``, pull it onto a host at v0."""
        self.runs += 1  # a fresh store per run: a remote prefix is never reused
        root = f"{self.store_root.rstrip('/')}/store-{encoding}-{self.runs}"
        store = VersionStore(root, self.storage_options)
        publisher = DeltaPublisher(store, self.base_dir, encoding=encoding, workers=self.workers)
        publisher.seed()
        host = os.path.join(self.workdir, f"host-{encoding}")
        shutil.rmtree(host, ignore_errors=True)
        pull = functools.partial(
            pull_weights, host, store, base_dir=self.base_dir, workers=self.workers
        )
        pull(0)
        publisher.pop_metrics()
        result, publish_s = _timed(lambda: publisher.publish(self.after.items()))
        metrics = publisher.pop_metrics()
        # Timed to the reply (what an engine waits for); the flush and the state after it.
        _, pull_s = _timed(lambda: pull(result.version, flush_after_reply=True))
        begun = time.perf_counter()
        wait_durable(host)
        durable_s = time.perf_counter() - begun
        phases = {k: float(metrics[k]) for k in PUBLISH_PHASES if k in metrics}
        phases["pull_durable_after_reply_s"] = durable_s
        self.paths[encoding].keep(result.wire_bytes, publish_s, pull_s, phases)
        if "://" not in root:
            shutil.rmtree(root, ignore_errors=True)

    def measure_full_copy(self) -> None:
        """Copy every base file (what shipping the whole checkpoint costs), fsynced."""

        def copy() -> int:
            total = 0
            for source in checkpoint_files(self.base_dir):
                target = os.path.join(self.workdir, "full-copy-" + os.path.basename(source))
                shutil.copyfile(source, target)
                with open(target, "rb+") as fh:
                    os.fsync(fh.fileno())
                total += os.path.getsize(target)
            return total

        total, seconds = _timed(copy)
        self.paths["full"].keep(total, seconds, seconds)

    def run_all(self, encodings: list[str], repeat: int, advance: Callable[[], None]) -> None:
        """Every path ``repeat`` times, interleaved so drift on a shared machine hits all alike."""
        for _ in range(repeat):
            self.measure_reference()
            advance()
            for encoding in encodings:
                self.measure_deltastore(encoding)
                advance()
            self.measure_full_copy()
            advance()


def _runs_progress(
    progress: ProgressCallback | None, model: Model, runs: int
) -> Callable[[], None]:
    """``advance()`` for each finished run of one path: the bar counts the model bytes synced,
    one model per run (the runs are measured without a callback, so it costs them nothing)."""
    size = sum(t.numel() * t.element_size() for t in model.values())
    meter = ProgressMeter.start(progress, "runs", runs * size)
    return (lambda: None) if meter is None else functools.partial(meter.advance, size)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _path_figures(path: Path, paths: dict[str, Path], size: int) -> dict[str, Any]:
    ref, upstream, full = paths["reference"], paths["upstream"], paths["full"]

    def gbps(seconds: float) -> float | None:
        return round(size / seconds / 1e9, 3) if seconds > 0 else None

    return {
        "wire_bytes": path.wire_bytes,
        "wire_pct_of_full": round(100 * path.wire_bytes / size, 4),
        "wire_vs_reference": _ratio(path.wire_bytes, ref.wire_bytes),
        "publish_s": round(path.publish_s, 4),
        "publish_vs_reference": _ratio(path.publish_s, ref.publish_s),
        "publish_vs_full_copy": _ratio(path.publish_s, full.publish_s),
        "publish_gbps": gbps(path.publish_s),
        "pull_s": round(path.pull_s, 4),
        "pull_vs_reference": _ratio(path.pull_s, ref.pull_s),
        "pull_vs_upstream": _ratio(path.pull_s, upstream.pull_s),
        "pull_vs_full_copy": _ratio(path.pull_s, full.pull_s),
        "pull_gbps": gbps(path.pull_s),
        "phase_s": {k: round(v, 4) for k, v in path.phases.items()},
        "phase_gbps": {k.removesuffix("_s"): gbps(v) for k, v in path.phases.items()},
    }


def _targets(
    kind: str, size: int, paths: dict[str, dict[str, Any]], own: str
) -> list[dict[str, Any]]:
    big = size >= BIG_MODEL_BYTES and kind in ("synthetic", "checkpoint")
    wanted = (
        ("wire_vs_reference", WIRE_TARGET),
        ("publish_vs_reference", 0.5 if big else 1.0),
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
    args: argparse.Namespace, kind: str, before: Model, after: Model, bench: Bench, repeat: int
) -> dict[str, Any]:
    """The bench's one JSON object (see docs/benchmarks.md for each key)."""
    import torch

    size = sum(t.numel() * t.element_size() for t in before.values())
    changed = sum(
        int(np.count_nonzero(host_bytes(n, before[n]) != host_bytes(n, after[n]))) for n in before
    )
    encodings = [name for name in bench.paths if name not in ("reference", "upstream", "full")]
    paths = {
        name: _path_figures(bench.paths[name], bench.paths, size)
        for name in ["reference", "upstream", *encodings]
    }
    own = "auto" if "auto" in encodings else encodings[-1]
    table, full = bench.paths[args.encoding or encodings[0]], bench.paths["full"]
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "model": {
            "kind": kind,
            "bytes": size,
            "tensors": len(before),
            "density_bytes": round(changed / size, 6),
            "simulated_density": None if args.next else args.density,
        },
        "workers": bench.workers,
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
        "targets": _targets(kind, size, paths, own),
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


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    repeat = args.steps or args.repeat
    encodings = [e for e in args.encodings.split(",") if e]
    for name in encodings + ([args.encoding] if args.encoding else []):
        if name not in ENCODINGS:
            raise ConfigError(f"unknown encoding {name!r}; known: {', '.join(sorted(ENCODINGS))}")
    if args.encoding and args.encoding not in encodings:
        encodings.append(args.encoding)
    if repeat < 1 or not encodings:
        raise ConfigError("--repeat must be ≥ 1 and --encodings must name one at least")
    kind, before, after = _models(args)
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="deltastore-bench-"))
        root, options = stack.enter_context(backend_store(args, workdir, "bench"))
        base = os.path.join(workdir, "base")
        os.makedirs(base)
        save_file(
            {n: t.contiguous() for n, t in before.items()}, os.path.join(base, "model.safetensors")
        )
        workers = args.workers or default_workers()
        bench = Bench(base, after, workdir, workers, root, options)
        what = f"bench {kind}: reference, {', '.join(encodings)}, full copy"
        with byte_progress(args, what) as progress:
            advance = _runs_progress(progress, before, repeat * (len(encodings) + 2))
            bench.run_all(encodings, repeat, advance)
    result = report(args, kind, before, after, bench, repeat)
    if args.json:
        print_json(result)
    else:
        print_tables(result, args.encoding or encodings[0])
    return 0
