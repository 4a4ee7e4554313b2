"""A collective publish of the demo model from several gloo ranks, with its metrics.

The model is ``deltastore demo``'s synthetic transformer (bf16, ``--size`` MB). Ranks hold
contiguous blocks of layers, like pipeline stages; the embedding is tied (held by the first and
the last rank, so it is deduplicated at every publish). Each step, every rank nudges its fp32
master weights by an Adam-like ±lr and publishes the bf16 cast (only the elements whose bf16
rounding flips change). A host then pulls the last version and verifies it against the
trainer's tensors byte for byte.

    python benchmarks/publish_ranks.py --ranks 2 --size 256 --steps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

from deltastore.publish import METRIC_KEYS
from deltastore.testing.servers import free_port

EMBED = "model.embed_tokens.weight"


def _master(name: str, shape: tuple[int, ...], seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.02


def _step(name: str, weight: Any, step: int, lr: float) -> None:
    import torch

    g = torch.Generator().manual_seed(step * 7_919 + zlib.crc32(name.encode()))
    weight.add_(torch.randn(weight.shape, generator=g).sign_() * lr)


def _layout(
    size_mb: float, ranks: int
) -> tuple[list[tuple[str, tuple[int, int]]], list[list[str]]]:
    from deltastore.cli.demo import layer_shapes

    shapes = layer_shapes(size_mb)
    names = [n for n, _ in shapes]
    blocks: list[list[str]] = [[] for _ in range(ranks)]
    per_rank = -(-len(names) // ranks)
    for i, name in enumerate(names):
        blocks[min(i // per_rank, ranks - 1)].append(name)
    if EMBED not in blocks[-1]:
        blocks[-1].append(EMBED)  # tied embedding: the last stage holds it too
    return shapes, blocks


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    import deltastore as ds

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    shapes, blocks = _layout(args.size, world)
    shape_of = dict(shapes)
    mine = blocks[rank]
    master = {n: _master(n, shape_of[n], args.seed) for n in mine}
    pub = ds.DeltaPublisher(ds.VersionStore(args.store), args.base, workers=args.workers)
    started = time.perf_counter()
    pub.seed()
    records: list[dict[str, Any]] = [{"seed_s": time.perf_counter() - started}]
    for step in range(1, args.steps + 1):
        for name, weight in master.items():
            _step(name, weight, step, args.lr)
        pub.publish((n, w.to(torch.bfloat16)) for n, w in master.items())
        metrics = pub.pop_metrics()
        assert pub.snapshot is not None
        metrics["snapshot_mb"] = pub.snapshot.loaded_bytes / 1e6
        records.append(metrics)
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    records.append({"peak_rss_mb": peak * 1024 / 1e6})
    Path(out).write_text(json.dumps(records))
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", type=float, default=256, help="model size in MB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    import deltastore as ds
    from deltastore.format.checkpoint import scan_checkpoint

    with tempfile.TemporaryDirectory(prefix="deltastore-ranks-") as tmp:
        args.base = os.path.join(tmp, "base")
        args.store = os.path.join(tmp, "store")
        os.makedirs(args.base)
        shapes, blocks = _layout(args.size, args.ranks)
        model = {n: _master(n, s, args.seed).to(torch.bfloat16) for n, s in shapes}
        save_file(model, os.path.join(args.base, "model.safetensors"))
        total = sum(t.numel() * 2 for t in model.values())
        del model
        print(
            f"model: {len(shapes)} bf16 tensors, {total / 1e6:.1f} MB; {args.ranks} ranks "
            f"holding {[len(b) for b in blocks]} tensors ({EMBED} tied on ranks 0 and "
            f"{args.ranks - 1}); {args.workers} encode workers per rank"
        )
        port = free_port()
        ctx = mp.get_context("fork")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.ranks)]
        procs = [
            ctx.Process(target=_rank, args=(r, args.ranks, port, args, outs[r]))
            for r in range(args.ranks)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        ranks = [json.loads(Path(o).read_text()) for o in outs]
        print(f"seed: {max(r[0]['seed_s'] for r in ranks):.2f} s (ranks load lazily)")
        # Every publish metric but the ones the same for each step of this run.
        keys = [k for k in METRIC_KEYS if k not in ("total_bytes", "tensors", "world_size")]
        for step in range(1, args.steps + 1):
            metrics = ranks[0][step]
            assert all(r[step] == metrics | {"snapshot_mb": r[step]["snapshot_mb"]} for r in ranks)
            print(json.dumps({k: metrics[k] for k in keys}))
        for rank, records in enumerate(ranks):
            print(
                f"rank {rank}: snapshot {records[-2]['snapshot_mb']:.1f} MB held, "
                f"peak RSS {records[-1]['peak_rss_mb']:.1f} MB"
            )

        store = ds.VersionStore(args.store)
        latest = store.latest()
        index = store.index(latest)
        print(f"weight_v{latest:06d} shards: {sorted(set(index.weight_map.values()))}")
        host = os.path.join(tmp, "host")
        started = time.perf_counter()
        result = ds.pull_weights(host, store, latest, base_dir=args.base)
        ds.verify_local(host, store, latest, base_dir=args.base)
        expected = {}
        for name, shape in shapes:
            weight = _master(name, shape, args.seed)
            for step in range(1, args.steps + 1):
                _step(name, weight, step, args.lr)
            expected[name] = weight.to(torch.bfloat16)
        local = scan_checkpoint(host)
        wrong = []
        for name, tensor in expected.items():
            entry = local[name]
            with open(entry.file, "rb") as fh:
                fh.seek(entry.entry.start)
                data = fh.read(entry.entry.nbytes)
            if data != tensor.contiguous().view(torch.uint8).numpy().tobytes():
                wrong.append(name)
        print(
            f"host pulled v{latest:06d} ({result.action}, {len(result.versions_applied)} "
            f"versions) in {time.perf_counter() - started:.2f} s; digests verified; "
            f"{len(expected) - len(wrong)}/{len(expected)} tensors equal the trainer's bytes"
        )
        if wrong:
            raise SystemExit(f"tensors differ: {wrong[:5]}")


if __name__ == "__main__":
    main()
