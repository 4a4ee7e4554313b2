"""Publish with host tensors viewed in place against the same tensors copied through the
staging pool (``stage_host_tensors=True``: the path a CUDA tensor takes, pinned buffers and
all but the DMA), on the bench's MoE model, in one process, alternating which goes first.

    python benchmarks/pool_staging.py --tensors 8000 --steps 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file

import deltastore as ds
from deltastore.cli.bench import moe_model, simulated_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=8000)
    parser.add_argument("--density", type=float, default=0.004)
    parser.add_argument("--steps", type=int, default=4, help="steps published (the first apart)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = moe_model(args.tensors, 0)
    (tmp / "base").mkdir()
    save_file(model, str(tmp / "base" / "model.safetensors"))
    publishers = {}
    for pooled in (False, True):
        store = ds.VersionStore(str(tmp / f"store-{pooled}"))
        publishers[pooled] = ds.DeltaPublisher(
            store, tmp / "base", encoding="auto", workers=2, stage_host_tensors=pooled
        )
        publishers[pooled].seed()
    best = {False: float("inf"), True: float("inf")}
    buffers = {}
    for step in range(1, args.steps + 1):
        model = simulated_step(model, args.density, step)
        for pooled in (False, True) if step % 2 else (True, False):
            started = time.perf_counter()
            publishers[pooled].publish(model)
            seconds = time.perf_counter() - started
            staging = publishers[pooled].last_staging
            assert staging is not None and staging.copied == (len(model) if pooled else 0)
            buffers[pooled] = staging.buffers_allocated
            if step > 1:
                best[pooled] = min(best[pooled], seconds)
    result = {
        "tensors": len(model),
        "publish_s": {"viewed": best[False], "pooled": best[True]},
        "pooled_vs_viewed": best[True] / best[False],
        "pool_buffers": buffers[True],
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
