"""End to end in seconds: train a small torch model, publish each step, pull into two hosts.

The model is saved as a Hugging Face checkpoint (``model.safetensors``, bf16: what an
inference engine loads) and is the engines' version 0. Each of three optimizer steps updates
fp32 master weights; the bf16 cast is published as a delta, pulled into two host directories
and verified there by per-tensor digests.

Run it: ``python examples/train_publish_pull.py [WORKDIR]`` (default: a temp dir).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from safetensors.torch import save_file

import deltastore as ds


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state the engines load: every parameter cast to bf16, contiguous."""
    return {
        name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()
    }


def main(workdir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)  # an RL fine-tuning learning rate

    base = os.path.join(workdir, "base")  # the engines' model path: version 0
    os.makedirs(base, exist_ok=True)
    save_file(bf16_state(model), os.path.join(base, "model.safetensors"))

    store = ds.VersionStore(os.path.join(workdir, "store"))  # or s3://, gs://, memory://
    publisher = ds.DeltaPublisher(store, base, encoding="xor", checksum="xxh3-128")
    publisher.seed()  # the snapshot of version 0; publishes nothing
    hosts = [os.path.join(workdir, f"host{i}") for i in (0, 1)]

    for step in range(1, 4):
        inputs = torch.randn(64, 256)
        loss = (model(inputs) - inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result = publisher.publish(bf16_state(model).items())
        for host in hosts:
            ds.pull_weights(host, store, result.version, base_dir=base)
            ds.verify_local(host, store, result.version, base_dir=base)
        print(
            f"step {step}: loss {loss.item():.4f}; weight_v{result.version:06d} "
            f"density {result.density:.2%}, {result.wire_bytes:,} wire bytes of "
            f"{result.total_bytes:,}; both hosts verified"
        )
    print(f"store {store.url}: versions {store.versions()}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="deltastore-example-") as tmp:
            main(tmp)
