"""Where a MoE delta's bytes go: the files of a stream's first two deltas.

    .venv/bin/python benchmarks/moe_wire.py
    .venv/bin/python benchmarks/moe_wire.py --tensors 8000 --density 0.004 --encoding auto

Builds ``deltastore bench``'s MoE model (``--tensors`` experts of 64 KB bf16) as the base,
seeds a publisher from it, publishes two steps of ``--density`` (elements moved ±1 ulp) and
prints, for ``weight_v000001`` (built on version 0, so it carries the ``base_digests`` record)
and ``weight_v000002``, the size of all its files, of its index, and of the record.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from safetensors.torch import save_file

import deltastore as ds
from deltastore.cli.bench import moe_model, simulated_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=8000)
    parser.add_argument("--density", type=float, default=0.004)
    parser.add_argument("--encoding", default="auto")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = moe_model(args.tensors, 0)
        os.makedirs(f"{root}/base")
        save_file(model, f"{root}/base/model.safetensors")
        store = ds.VersionStore(f"{root}/store")
        publisher = ds.DeltaPublisher(
            store, f"{root}/base", encoding=args.encoding, workers=args.workers
        )
        publisher.seed()
        for seed in (1, 2):
            model = simulated_step(model, args.density, seed)
            publisher.publish(model.items())
        report = {}
        for version in (1, 2):
            vdir = f"{root}/store/weight_v{version:06d}"
            sizes = {name: os.path.getsize(f"{vdir}/{name}") for name in os.listdir(vdir)}
            with open(f"{vdir}/{ds.format.INDEX_NAME}") as fh:
                record = json.load(fh)["metadata"].get("base_digests")
            report[f"weight_v{version:06d}"] = {
                "all_files": sum(sizes.values()),
                "index": sizes[ds.format.INDEX_NAME],
                "base_digests_bytes": len(json.dumps(record)) if record else 0,
                "base_digests_tensors": len(record["tensors"]) if record else None,
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
