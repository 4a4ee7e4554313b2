"""The floor of a CPU commit: scattered writes of changed elements against a whole-tensor copy.

    .venv/bin/python benchmarks/commit_floor.py
    .venv/bin/python benchmarks/commit_floor.py --mib 1024 --densities 0.001 0.004 --json

A ``LiveWeights`` commit on the CPU writes each changed element where it lies
(``deltastore.engines.commit.put_words``, the function a commit calls); a reference engine's
reload from the page cache is a copy of every byte. This measures both on one bf16 tensor of
``--mib`` MiB (larger than the last-level cache, so neither runs from it), at each density of
changed elements, in one process: the copy, the commit's write alone, and the write with the
read-back ``verify="patched"`` does. The ratio against the copy grows with the density (each
changed element costs about one cache miss; the copy streams), which says from which density a
commit in CPU memory cannot be ten times cheaper than the reload it replaces.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from deltastore.engines.commit import put_words
from deltastore.engines.targets import Target


def best(fn: Callable[[], object], evict: np.ndarray, repeat: int) -> float:
    """The fastest of ``repeat`` runs, each after writing ``evict`` (out of the cache)."""
    fastest = float("inf")
    for round_ in range(repeat):
        evict[:] = round_
        start = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the bf16 tensor")
    parser.add_argument(
        "--densities",
        type=float,
        nargs="+",
        default=[0.0001, 0.0005, 0.001, 0.002, 0.004, 0.01],
        help="fractions of its elements changed",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per density")
    args = parser.parse_args()
    elements = args.mib * 2**20 // 2
    live = torch.zeros(elements, dtype=torch.bfloat16)
    checkpoint = torch.ones(elements, dtype=torch.bfloat16)
    evict = np.zeros(2 * args.mib * 2**20, np.uint8)
    target = Target("t", "t", live, 2)
    copy_s = best(lambda: live.copy_(checkpoint), evict, args.repeat)
    if not args.json:
        print(f"copy of {args.mib} MiB (the reload's floor): {copy_s * 1e3:.1f} ms")
    rng = np.random.default_rng(0)
    for density in args.densities:
        positions = torch.from_numpy(np.flatnonzero(rng.random(elements) < density))
        values = torch.full((positions.numel(),), 7, dtype=torch.int16)
        write = functools.partial(put_words, target, positions, values)
        write_s = best(write, evict, args.repeat)
        checked_s = best(functools.partial(write, check=True), evict, args.repeat)
        row = {
            "mib": args.mib,
            "density": density,
            "elements": positions.numel(),
            "copy_s": copy_s,
            "write_s": write_s,
            "write_and_read_back_s": checked_s,
            "ns_per_element": write_s / max(1, positions.numel()) * 1e9,
            "write_over_copy": write_s / copy_s,
            "checked_over_copy": checked_s / copy_s,
        }
        if args.json:
            print(json.dumps(row))
            continue
        print(
            f"density {density * 100:.2f} %: {positions.numel()} elements, write "
            f"{write_s * 1e3:.1f} ms ({row['ns_per_element']:.0f} ns each, "
            f"{row['write_over_copy']:.2f}x the copy), with the read-back "
            f"{checked_s * 1e3:.1f} ms ({row['checked_over_copy']:.2f}x)"
        )


if __name__ == "__main__":
    main()
