"""One-step pulls of the bench's many-tensor models against the reference-style in-place pull.

    python benchmarks/pull_many_tensors.py moe xor,auto 3          # ratios, best of 3
    py-spy record -r 250 --native -f raw -o pull.txt -- \\
        python benchmarks/pull_many_tensors.py moe auto 6          # where a pull's time goes

Builds ``deltastore bench``'s ``moe`` (8,000 bf16 tensors of 64 KB) or ``small`` (386 tensors)
model and its simulated step, publishes the step once per encoding (2 workers) and the
reference-style delta shard (``deltastore.cli.reference``), then times, best of ``repeat``,
alternately: the reference pull onto a copy of the base file, and ``pull_weights`` from v0 to
v1 onto a copy of a host at v0, in this process (which holds both models, as the bench does).
Prints each time and its ratio to the reference's, with the load average. The pulls are the
bench's; only the publish and the host at v0 are made once, so repeats are cheap to profile.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from safetensors.torch import save_file

from deltastore.cli import bench as models
from deltastore.cli.bench import settle
from deltastore.cli.reference import reference_publish, reference_pull
from deltastore.publish import DeltaPublisher
from deltastore.publish.device import host_bytes
from deltastore.pull import pull_weights
from deltastore.storage import VersionStore

WORKERS = 2


def main(model: str, encodings: list[str], repeat: int) -> None:
    before = models.moe_model(8000, 0) if model == "moe" else models.small_model(24, 0)
    after = models.simulated_step(before, 0.004, 1)
    work = tempfile.mkdtemp(prefix="deltastore-pull-many-")
    try:
        base = os.path.join(work, "base")
        os.makedirs(base)
        base_file = os.path.join(base, "model.safetensors")
        save_file({n: t.contiguous() for n, t in before.items()}, base_file)
        snapshot = {n: host_bytes(n, t.contiguous()).copy() for n, t in before.items()}
        shard = os.path.join(work, "reference.safetensors")
        reference_publish(
            snapshot, [(n, host_bytes(n, t)) for n, t in after.items()], shard, WORKERS
        )
        del snapshot
        stores = {}
        for encoding in encodings:
            store = VersionStore(os.path.join(work, f"store-{encoding}"))
            publisher = DeltaPublisher(store, base, encoding=encoding, workers=WORKERS)
            publisher.seed()
            at_v0 = os.path.join(work, f"host-v0-{encoding}")
            pull_weights(at_v0, store, 0, base_dir=base, workers=WORKERS)
            stores[encoding] = (store, at_v0, publisher.publish(after.items()).version)
        best = dict.fromkeys(["reference", *encodings], float("inf"))
        host_file, host = os.path.join(work, "reference-host"), os.path.join(work, "host")
        for _ in range(repeat):
            shutil.copyfile(base_file, host_file)
            settle()
            begun = time.perf_counter()
            reference_pull(shard, host_file, WORKERS)
            best["reference"] = min(best["reference"], time.perf_counter() - begun)
            for encoding, (store, at_v0, version) in stores.items():
                shutil.rmtree(host, ignore_errors=True)
                shutil.copytree(at_v0, host)
                settle()
                begun = time.perf_counter()
                pull_weights(host, store, version, base_dir=base, workers=WORKERS)
                best[encoding] = min(best[encoding], time.perf_counter() - begun)
        ratios = " ".join(f"{k} {v:.3f} s ({v / best['reference']:.2f})" for k, v in best.items())
        print(f"{model} (load {os.getloadavg()[0]:.1f}): {ratios}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 3)
