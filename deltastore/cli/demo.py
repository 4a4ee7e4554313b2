"""``deltastore demo``: the whole job on a synthetic model, end to end, with a table of figures.

A synthetic bf16 model is trained for a few steps the way RL fine-tuning does it: fp32 master
weights take a small optimizer step and are cast to bf16, so only the few elements whose bf16
rounding flips actually change. Each step is published, pulled into two host directories,
verified, and reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

from deltastore.cli.common import Subparsers, add_codec_flags, add_command, phase, step_progress
from deltastore.cli.emulate import backend_store
from deltastore.errors import ConfigError
from deltastore.publish import DeltaPublisher
from deltastore.pull import pull_weights, verify_local
from deltastore.storage import VersionStore


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "demo",
        run,
        "publish and pull a synthetic model end to end and print the figures",
        "Build a synthetic bf16 model, seed, simulate training steps with realistic sparse "
        "changes, publish each, pull into two host dirs, verify, and print a table.",
        json=None,
    )
    p.add_argument("--size", type=float, default=256, help="model size in MB (default 256)")
    p.add_argument("--steps", type=int, default=4, help="training steps to publish (default 4)")
    p.add_argument(
        "--lr",
        type=float,
        default=2e-7,
        help="effective per-element optimizer step (default 2e-7: ~0.4%% of bytes change per step)",
    )
    p.add_argument("--store", help="store URL (default: a local dir in a temp dir)")
    p.add_argument(
        "--backend",
        choices=("local", "memory", "s3", "gcs"),
        default="local",
        help="where the default store lives; s3 / gcs start an embedded emulator (moto / "
        "fake-gcs-server, as `deltastore emulate` does)",
    )
    add_codec_flags(p)
    p.add_argument("--workdir", help="keep the files here instead of a temp dir")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _layout_bytes(hidden: int) -> tuple[int, int, int, int]:
    """(intermediate, vocab, bf16 bytes per layer, bf16 bytes of embed + lm_head)."""
    intermediate = hidden * 11 // 4  # 2816 for hidden 1024, as in small Llama-like models
    vocab = 8 * hidden
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)  # attention + MLP
    return intermediate, vocab, per_layer, 2 * 2 * vocab * hidden


def layer_shapes(size_mb: float) -> list[tuple[str, tuple[int, int]]]:
    """A transformer-like layout of bf16 tensors adding up to about ``size_mb`` MB: the widest
    hidden size (1024 down to 64) whose layer count comes within 10 % (else the closest)."""
    target = size_mb * 1e6

    def fit(hidden: int) -> tuple[int, float]:
        _, _, per_layer, embed = _layout_bytes(hidden)
        layers = max(1, round((target - embed) / per_layer))
        return layers, abs(embed + layers * per_layer - target) / target

    widths = [1024, 512, 256, 128, 64]
    hidden = next((h for h in widths if fit(h)[1] <= 0.1), min(widths, key=lambda h: fit(h)[1]))
    layers = fit(hidden)[0]
    intermediate, vocab, _, _ = _layout_bytes(hidden)
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((f"{prefix}.self_attn.{proj}.weight", (hidden, hidden)))
        shapes.append((f"{prefix}.mlp.gate_proj.weight", (intermediate, hidden)))
        shapes.append((f"{prefix}.mlp.up_proj.weight", (intermediate, hidden)))
        shapes.append((f"{prefix}.mlp.down_proj.weight", (hidden, intermediate)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


class SyntheticTraining:
    """fp32 master weights of a transformer-like layout and their bf16 cast (the model);
    :meth:`step` moves every master weight by ``±lr`` (see the module docstring)."""

    def __init__(self, size_mb: float, seed: int) -> None:
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        self.master = {
            name: torch.randn(shape, generator=self.generator) * 0.02
            for name, shape in layer_shapes(size_mb)
        }
        self.model = {name: w.to(torch.bfloat16) for name, w in self.master.items()}
        self.total_bytes = sum(t.numel() * t.element_size() for t in self.model.values())

    def step(self, lr: float) -> None:
        import torch

        for name, weight in self.master.items():
            weight.add_(torch.randn(weight.shape, generator=self.generator).sign_() * lr)
            self.model[name] = weight.to(torch.bfloat16)


def _one_step(
    args: argparse.Namespace,
    training: SyntheticTraining,
    publisher: DeltaPublisher,
    hosts: list[str],
    base: str,
) -> tuple[dict[str, str], int]:
    """Train one step, publish it, pull and verify it on every host: the table row (by
    column) and the version's wire bytes."""
    training.step(args.lr)
    result = publisher.publish(training.model.items())
    metrics = publisher.pop_metrics()
    pulls = []
    for host in hosts:
        t0 = time.perf_counter()
        pull_weights(host, publisher.store, result.version, base_dir=base)
        pulls.append(time.perf_counter() - t0)
        verify_local(host, publisher.store, result.version, base_dir=base)
    row = {
        "version": f"{result.version:06d}",
        "density": f"{result.density:.3%}",
        "wire MB": f"{result.wire_bytes / 1e6:.2f}",
        "wire % of full": f"{result.wire_bytes / training.total_bytes:.2%}",
        "publish s": f"{metrics['publish_s']:.2f}",
        "pull s host0": f"{pulls[0]:.2f}",
        "pull s host1": f"{pulls[1]:.2f}",
    }
    return row, result.wire_bytes


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from safetensors.torch import save_file

    console = Console(width=max(100, Console().width))
    if args.steps < 1 or args.size <= 0:
        raise ConfigError("--steps must be ≥ 1 and --size > 0")
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="deltastore-demo-")
        )
        url, options = stack.enter_context(
            backend_store(args, os.path.join(workdir, "store"), "demo")
        )
        base = os.path.join(workdir, "base")
        hosts = [os.path.join(workdir, f"host{i}") for i in (0, 1)]
        os.makedirs(base, exist_ok=True)

        training = SyntheticTraining(args.size, args.seed)
        model = training.model
        save_file(model, os.path.join(base, "model.safetensors"))
        total = training.total_bytes
        console.print(
            f"synthetic model: {len(model)} bf16 tensors, {total / 1e6:.1f} MB (--size "
            f"{args.size:g}); store {url}"
        )

        store = VersionStore(url, options)
        if store.versions():
            raise ConfigError(
                f"{url} already holds versions (an earlier demo's?); the demo starts a new "
                "stream: pass an empty --store or a new --workdir"
            )
        publisher = DeltaPublisher(store, base, encoding=args.encoding, checksum=args.checksum)
        started = time.perf_counter()
        with phase(args, "seeding the snapshot and the two hosts"):
            publisher.seed()
            seed_s = time.perf_counter() - started
            for host in hosts:  # version 0: each host materialises the base
                pull_weights(host, store, 0, base_dir=base)
        console.print(f"seeded snapshot in {seed_s:.2f} s; hosts hold the base (v0)")

        table = Table(title=f"deltastore demo: {args.encoding} + {args.checksum}, zstd-1")
        advance = stack.enter_context(
            step_progress(args, "train, publish, pull x2, verify", args.steps)
        )
        wire_bytes = 0
        for _ in range(args.steps):
            row, wire_bytes = _one_step(args, training, publisher, hosts, base)
            if not table.columns:  # the first row names them
                for column in row:
                    table.add_column(column, justify="right")
            table.add_row(*row.values())
            advance()
        console.print(table)
        console.print(
            f"every version was verified on both hosts by per-tensor digests; the last step "
            f"moved {wire_bytes / 1e6:.2f} MB instead of a {total / 1e6:.1f} MB checkpoint"
        )
    return 0
