"""The models ``deltastore bench`` measures: before/after tensors of one training step.

* ``synthetic``: ``deltastore demo``'s transformer layout in bf16 (few, large tensors);
* ``small``: a narrow transformer with hundreds of small tensors (biases, norms, 256-wide
  projections): per-tensor costs dominate;
* ``moe``: expert tensors of 64 KB bf16 each (8,000 of them are 524 MB), MoE-shaped;
* ``checkpoint``: real weights from a safetensors directory, with a second checkpoint as the
  step or a simulated one.

The simulated step moves ``density`` of each floating tensor's elements by ±1 ulp at random
positions (what an Adam step does to bf16 weights: nearly every change is one rounding flip).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch

from deltastore.cli.demo import layer_shapes
from deltastore.errors import ConfigError

Model = dict[str, torch.Tensor]

_SIGNED_VIEWS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def synthetic_model(size_mb: float, seed: int) -> Model:
    """bf16 tensors of a transformer-like layout adding up to about ``size_mb`` MB."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in layer_shapes(size_mb)
    }


def small_model(layers: int, seed: int) -> Model:
    """A 256-wide transformer: 16 tensors per layer, most of them 0.5 KB to 512 KB."""
    generator = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (4096, 256))]
    for i in range(layers):
        p = f"layers.{i}"
        for proj in ("q", "k", "v", "o"):
            shapes += [(f"{p}.attn.{proj}.weight", (256, 256)), (f"{p}.attn.{proj}.bias", (256,))]
        shapes += [(f"{p}.mlp.up.weight", (1024, 256)), (f"{p}.mlp.up.bias", (1024,))]
        shapes += [(f"{p}.mlp.down.weight", (256, 1024)), (f"{p}.mlp.down.bias", (256,))]
        for norm in ("norm1", "norm2"):
            shapes += [(f"{p}.{norm}.weight", (256,)), (f"{p}.{norm}.bias", (256,))]
    shapes.append(("lm_head.weight", (4096, 256)))
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in shapes
    }


def moe_model(tensors: int, seed: int) -> Model:
    """``tensors`` expert tensors of 64 KB bf16 (32,768 elements each)."""
    generator = torch.Generator().manual_seed(seed)
    experts = (torch.randn((tensors, 32768), generator=generator) * 0.02).to(torch.bfloat16)
    return {f"experts.{i}.weight": experts[i] for i in range(tensors)}


def checkpoint_model(directory: str) -> Model:
    """Every tensor of the safetensors files in ``directory``."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"--checkpoint {directory} holds no *.safetensors file")
    model: Model = {}
    for path in files:
        model.update(load_file(path))
    return model


def simulated_step(model: Model, density: float, seed: int) -> Model:
    """A copy of ``model`` with ``density`` of each floating tensor's elements moved ±1 ulp."""
    if not 0.0 <= density <= 1.0:
        raise ConfigError(f"--density must be between 0 and 1, got {density}")
    rng = np.random.default_rng(seed)
    stepped: Model = {}
    for name, tensor in model.items():
        out = tensor.clone()
        signed = _SIGNED_VIEWS.get(out.dtype)
        if signed is not None and out.numel():
            flat = out.reshape(-1).view(signed).numpy()
            count = int(rng.binomial(flat.size, density))
            where = np.unique(rng.integers(0, flat.size, count))
            flat[where] += rng.choice(np.array([-1, 1], dtype=flat.dtype), where.size)
        stepped[name] = out
    return stepped
