"""Peak memory of one publish beyond what the trainer already holds (docs/publishing.md).

Each measurement runs in a fresh subprocess (or a fresh set of gloo ranks): seed the publisher
(the snapshot), build the trainer's new tensors, then reset the kernel's peak-RSS mark
(``/proc/self/clear_refs`` ← 5, Linux ≥ 4.0) and publish; the overhead is ``VmHWM`` after the
publish minus ``VmRSS`` before it (after ``malloc_trim``), less the snapshot tensors a rank
loads on first use inside the publish: the memory the publish itself needed on top of the
snapshot and the trainer's tensors.

    python benchmarks/publish_memory.py                         # 16 x 16 MiB bf16 (256 MiB)
    python benchmarks/publish_memory.py --tensors 8 --tensor-mib 64 --workers 1 2 4
    python benchmarks/publish_memory.py --ranks 2               # per-rank figures, gloo

Figures are printed as a table and as JSON lines (``--json``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def make_base(directory: Path, tensors: int, tensor_mib: int) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    elements = tensor_mib * MIB // 2
    model = {f"model.layers.{i}.weight": torch.randn(elements, generator=g) for i in range(tensors)}
    bf16 = {n: t.to(torch.bfloat16) for n, t in model.items()}
    save_file(bf16, str(directory / "model.safetensors"))


def _new_tensors(base: Path, names: list[str], density: float) -> dict[str, Any]:
    """The trainer's tensors: the base with ``density`` of each tensor's elements nudged."""
    import torch
    from safetensors.torch import load_file

    tensors = {n: t for n, t in load_file(str(base / "model.safetensors")).items() if n in names}
    g = torch.Generator().manual_seed(1)
    for t in tensors.values():
        flat = t.view(-1)
        count = max(1, int(flat.numel() * density))
        if density >= 1.0:
            flat.add_(torch.randn(flat.numel(), generator=g).to(flat.dtype), alpha=0.01)
        else:
            step = max(1, flat.numel() // count)
            flat[::step] += 1.0
    return tensors


def measure(args: argparse.Namespace, rank: int = 0, world: int = 1) -> dict[str, Any]:
    import gc

    import deltastore as ds

    base = Path(args.base)
    names = [f"model.layers.{i}.weight" for i in range(args.tensors)]
    mine = [n for i, n in enumerate(names) if i % world == rank]
    pub = ds.DeltaPublisher(
        ds.VersionStore(args.store),
        base,
        workers=args.workers,
        preload=world == 1,
        spool_memory_bytes=args.spool_mib * MIB,
    )
    pub.seed()
    tensors = _new_tensors(base, mine, args.density)
    gc.collect()
    # Hand freed heap back to the kernel, so the publish cannot hide in memory that was
    # allocated before the measurement started.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    assert pub.snapshot is not None
    held = pub.snapshot.loaded_bytes
    before = _status_kib("VmRSS") * 1024
    _reset_peak()
    started = time.perf_counter()
    result = pub.publish(tensors.items(), full=args.full)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM") * 1024
    largest = args.tensor_mib * MIB
    # Ranks load their share of the snapshot on first use, i.e. inside this publish.
    loaded = pub.snapshot.loaded_bytes - held
    overhead = peak - before - loaded
    metrics = pub.pop_metrics()
    return {
        "rank": rank,
        "ranks": world,
        "workers": args.workers,
        "spool_mib": args.spool_mib,
        "density": args.density,
        "kind": result.kind,
        "model_mib": args.tensors * args.tensor_mib,
        "largest_tensor_mib": args.tensor_mib,
        "snapshot_mib": round(pub.snapshot.loaded_bytes / MIB, 1),
        "rss_before_mib": round(before / MIB, 1),
        "peak_mib": round(peak / MIB, 1),
        "snapshot_loaded_in_publish_mib": round(loaded / MIB, 1),
        "overhead_mib": round(overhead / MIB, 1),
        "overhead_per_largest_tensor": round(overhead / largest, 2),
        "wire_mib": round(result.wire_bytes / MIB, 2),
        "density_measured": round(result.density, 4),
        "publish_s": round(seconds, 2),
        "metrics": metrics,
    }


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    record = measure(args, rank, world)
    Path(out).write_text(json.dumps(record))
    dist.barrier()
    os._exit(0)


def child(args: argparse.Namespace) -> None:
    if args.ranks == 1:
        print(json.dumps(measure(args)))
        return
    import multiprocessing as mp

    from deltastore.testing.servers import free_port

    port = free_port()
    ctx = mp.get_context("fork")
    outs = [f"{args.store}.rank{r}.json" for r in range(args.ranks)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.ranks, port, args, outs[r]))
        for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    for out in outs:
        print(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 1.0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument(
        "--spool-mib", type=int, default=256, help="in-memory payload spool (library default)"
    )
    parser.add_argument("--full", action="store_true", help="also measure a full publish")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.workers = args.workers[0]
        args.density = args.density[0]
        child(args)
        return
    records = []
    with tempfile.TemporaryDirectory(prefix="deltastore-mem-") as tmp:
        base = Path(tmp, "base")
        make_base(base, args.tensors, args.tensor_mib)
        runs = [(w, d, False) for w in args.workers for d in args.density]
        if args.full:
            runs.append((args.workers[-1], args.density[0], True))
        for i, (workers, density, full) in enumerate(runs):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--base",
                str(base),
                "--store",
                str(Path(tmp, f"store{i}")),
                "--tensors",
                str(args.tensors),
                "--tensor-mib",
                str(args.tensor_mib),
                "--workers",
                str(workers),
                "--density",
                str(density),
                "--ranks",
                str(args.ranks),
                "--spool-mib",
                str(args.spool_mib),
            ] + (["--full"] if full else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            records.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    if args.json:
        for record in records:
            print(json.dumps(record))
        return
    header = (
        "ranks rank workers spool density kind  snapshot  loaded_in_publish  rss_before  peak  "
        "  overhead  x_largest  wire_MiB  publish_s"
    )
    print(
        f"model: {args.tensors} x {args.tensor_mib} MiB bf16 = {args.tensors * args.tensor_mib} MiB"
    )
    print(header)
    for r in records:
        print(
            f"{r['ranks']:>5} {r['rank']:>4} {r['workers']:>7} {r['spool_mib']:>5} "
            f"{r['density']:>7} {r['kind']:>5} "
            f"{r['snapshot_mib']:>8} {r['snapshot_loaded_in_publish_mib']:>18} "
            f"{r['rss_before_mib']:>11} {r['peak_mib']:>7} "
            f"{r['overhead_mib']:>9} {r['overhead_per_largest_tensor']:>10} "
            f"{r['wire_mib']:>9} {r['publish_s']:>10}"
        )


if __name__ == "__main__":
    main()
