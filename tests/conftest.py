"""Shared fixtures: small HF safetensors checkpoints built from real files, and runs of
versions published from them.

``make_checkpoint(directory, tensors, shards=1)`` writes a checkpoint the way HF tools do
(``safetensors.torch.save_file`` per shard, plus ``model.safetensors.index.json`` when sharded);
every test that needs a checkpoint on disk writes it with this. ``publish_run(store, base,
models)`` seeds a real ``DeltaPublisher`` and publishes each model in turn: the one way the
tests fill a store with a run of versions.
``small_model`` is a handful of tiny tensors covering every dtype deltastore must treat
byte-blindly (bf16, fp16, fp32, float8_e4m3fn, int8, bool) including a 0-d and an empty one;
``base_dir`` is a temp directory holding it as a two-shard checkpoint. ``checkpoint_bytes`` and
``raw_bytes`` read tensors back as raw bytes, for byte-exact comparisons; ``perturb`` makes a
sparse, deterministic "training step" change. ``s3_server``/``gcs_server`` start moto and
fake-gcs-server once per session; ``s3_url``/``gcs_url`` give each test a fresh store root.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class when first imported; the experimental one probes every
# bucket over gRPC and retries for about a minute against an emulator. Must precede any import
# of gcsfs anywhere in the test session.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import importlib.util
import json
import signal
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import deltastore as ds
from deltastore.testing.servers import GCSServer, S3Server, start_fake_gcs, start_moto_s3

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
"""Whether the compiled codec backend (the ``fast`` extra) can run here."""

INDEX_NAME = "model.safetensors.index.json"

# A suite started in the background of a non-interactive shell (`nohup ... &`) inherits SIGINT
# ignored, and so would every CLI it spawns: the tests that press Ctrl-C on one would hang or
# see it finish. A handler here is reset to the default at exec, so children take Ctrl-C again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def make_checkpoint(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    shards: int = 1,
    *,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` as an HF safetensors checkpoint in ``directory`` and return its path.

    With ``shards == 1`` the checkpoint is a single ``model.safetensors``; otherwise the
    tensors are dealt round-robin (in name order) into ``model-0000i-of-0000n.safetensors``
    files (1-based, HF style) and an index maps each name to its file. Tensors are made
    contiguous and cloned so that views of one storage can be saved together.
    ``extra_files`` (file name → text, e.g. a ``config.json``) are written beside them.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (extra_files or {}).items():
        (root / name).write_text(text)
    names = sorted(tensors)
    if shards <= 1:
        save_file(
            {n: tensors[n].contiguous().clone() for n in names}, str(root / "model.safetensors")
        )
        return root
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    for i, name in enumerate(names):
        groups[i % shards][name] = tensors[name].contiguous().clone()
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(group, str(root / file_name))
        weight_map.update({name: file_name for name in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return root


@dataclass
class PublishedRun:
    """What :func:`publish_run` published: the publisher (still open) and each version's model."""

    publisher: ds.DeltaPublisher
    models: dict[int, Mapping[str, torch.Tensor]] = field(default_factory=dict)


def publish_run(
    store: ds.VersionStore | str | os.PathLike[str],
    base_dir: str | os.PathLike[str],
    models: Iterable[Mapping[str, torch.Tensor]],
    *,
    full_at: Collection[int] = (),
    **options: Any,
) -> PublishedRun:
    """Seed a ``DeltaPublisher(store, base_dir, **options)`` and publish each of ``models`` as
    the next version, a full one when its number is in ``full_at``. ``models`` may be a
    generator: each model is made only once the previous version is published."""
    target = store if isinstance(store, ds.VersionStore) else os.fspath(store)
    publisher = ds.DeltaPublisher(target, os.fspath(base_dir), **options)
    publisher.seed()
    run = PublishedRun(publisher)
    for model in models:
        result = publisher.publish(model.items(), full=publisher.next_version in full_at)
        run.models[result.version] = model
    return run


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian storage bytes of a tensor in row-major order (any dtype, any view)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def checkpoint_bytes(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """Name → raw bytes of every tensor in every ``*.safetensors`` file of ``directory``."""
    out: dict[str, bytes] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert name not in out, f"{name} appears twice in {directory}"
                out[name] = raw_bytes(fh.get_tensor(name))
    return out


def small_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few small tensors of mixed dtypes, deterministic for ``seed``.

    Covers bf16, fp16, fp32, float8_e4m3fn, int8 and bool, a 0-d scalar and an empty tensor.
    """
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
        "model.layers.0.mlp.fp8_weight": torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.quant.scale_int8": torch.randint(
            -128, 128, (64,), generator=g, dtype=torch.int8
        ),
        "model.layers.0.mask": torch.rand(5, 7, generator=g) > 0.5,
        "model.norm.eps": torch.tensor(1e-5, dtype=torch.float32),
        "model.empty_bias": torch.zeros(0, dtype=torch.bfloat16),
    }


def perturb(tensors: Mapping[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` where two of them (chosen by ``step``) have a few bytes changed.

    Byte-level and dtype-blind like the codecs (bool bytes stay 0/1); deterministic for
    ``step``, and different steps change different tensors and positions.
    """
    out = {name: t.clone() for name, t in tensors.items()}
    names = sorted(n for n, t in out.items() if t.numel())
    for name in {names[step % len(names)], names[(3 * step + 1) % len(names)]}:
        flat = out[name].reshape(-1).view(torch.uint8)
        mask = 1 if out[name].dtype == torch.bool else 0x5A
        for i in range(3):
            flat[(7 * step + 13 * i) % flat.numel()] ^= mask
    return out


@pytest.fixture
def small_model() -> dict[str, torch.Tensor]:
    """A dict of small mixed-dtype tensors (see ``small_tensors``)."""
    return small_tensors()


@pytest.fixture
def base_dir(tmp_path: Path, small_model: dict[str, torch.Tensor]) -> Path:
    """A temp directory holding ``small_model`` as a two-shard HF checkpoint."""
    return make_checkpoint(tmp_path / "base", small_model, shards=2)


# Object-store servers: one of each per session (moto S3 in a thread, fake-gcs-server as a child
# process, both on 127.0.0.1), started only by the tests that use them; every test gets its own
# prefix, so tests never see each other's objects.
STORE_BUCKET = "deltastore-store-tests"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with start_moto_s3() as server:
        server.make_bucket(STORE_BUCKET)
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    with start_fake_gcs() as server:
        server.make_bucket(STORE_BUCKET)
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A fresh ``s3://`` store root on the session's moto server."""
    return f"s3://{STORE_BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def gcs_url(gcs_server: GCSServer) -> str:
    """A fresh ``gs://`` store root on the session's fake-gcs-server."""
    return f"gs://{STORE_BUCKET}/{uuid.uuid4().hex[:12]}"
