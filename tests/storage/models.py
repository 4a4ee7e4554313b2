"""A tiny model that changes a little at each step, and its base checkpoint on disk."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import make_checkpoint


def model_at(step: int) -> dict[str, torch.Tensor]:
    """The model after ``step`` training steps: each step changes a few elements of two
    tensors (mixed dtypes)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(32, 16, generator=g),
        "layers.0.norm.weight": torch.ones(16, dtype=torch.float16),
        "lm_head.bias": torch.zeros(8, dtype=torch.int8),
    }
    for s in range(1, step + 1):
        tensors["layers.0.mlp.weight"][s % 32, : s + 1] += 0.5
        tensors["embed.weight"][(7 * s) % 64, 3] = float(s)
    return tensors


def write_base(directory: Path) -> Path:
    """The base checkpoint (step 0) as one ``model.safetensors`` in ``directory``."""
    return make_checkpoint(directory, model_at(0))


def local_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def assert_model(directory: Path, step: int) -> None:
    """``directory`` holds exactly the model at ``step``, bit for bit."""
    got = local_tensors(directory)
    want = model_at(step)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
