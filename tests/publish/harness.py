"""Running a function on N real ranks (processes) joined by a gloo group on 127.0.0.1.

``run_ranks(world, fn, ...)`` forks ``world`` processes; each initialises
``torch.distributed`` (gloo, TCP rendezvous on a free local port), runs ``fn(rank, world,
**kwargs)`` and pickles ``("ok", value)`` or ``("error", type name, message)`` to a file the
parent reads. Fork (not spawn) keeps a 4-rank start well under a second on 2 cores; children
use one intra-op thread.

Also the test model: ``model_at(step)`` is the full model after ``step`` training steps, where
``CHANGES[step]`` names the tensors that step changes, so every rank and the parent agree on
every tensor's bytes at every version without talking to each other.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from deltastore.testing.servers import free_port
from tests.conftest import checkpoint_bytes, make_checkpoint, raw_bytes

RANK_TIMEOUT_S = 60.0


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    outs: list[str],
    kwargs: dict[str, Any],
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: tuple[Any, ...]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=RANK_TIMEOUT_S - 15),
        )
        result = ("ok", fn(rank, world, **kwargs))
    except BaseException as exc:  # reported to the parent, which fails the test
        result = ("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    out = outs[rank]
    with open(out + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(out + ".tmp", out)
    if rank == 0:
        # Rank 0 serves the rendezvous store: stay until every rank is done with it.
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not all(os.path.exists(o) for o in outs) and time.monotonic() < deadline:
            time.sleep(0.01)
    # Skip interpreter teardown: a peer that already failed must not make us hang in atexit.
    os._exit(0)


def start_ranks(
    world: int, fn: Callable[..., Any], workdir: Path, **kwargs: Any
) -> tuple[list[Any], list[str]]:
    """Fork ``world`` ranks running ``fn``; returns the processes and their result paths."""
    ctx = mp.get_context("fork")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    outs = [str(workdir / f"rank{r}-{port}.pkl") for r in range(world)]
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, outs, kwargs), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    return procs, outs


def collect(procs: list[Any], outs: list[str], timeout: float = RANK_TIMEOUT_S) -> list[Any]:
    """Wait for every rank; kill them all if one hangs. Returns each rank's value, or raises
    AssertionError with the failing ranks' errors."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    results = []
    for rank, out in enumerate(outs):
        if not os.path.exists(out):
            results.append(("error", "NoResult", f"rank {rank} wrote no result (hung={hung})"))
            continue
        with open(out, "rb") as fh:
            results.append(pickle.load(fh))
    errors = [f"rank {r}: {res[1]}: {res[2]}" for r, res in enumerate(results) if res[0] != "ok"]
    assert not errors, "\n".join(errors)
    assert not hung, f"ranks {hung} hung"
    return [res[1] for res in results]


def run_ranks(world: int, fn: Callable[..., Any], workdir: Path, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` gloo ranks; each rank's return value."""
    procs, outs = start_ranks(world, fn, workdir, **kwargs)
    return collect(procs, outs)


# ---------------------------------------------------------------------------- the test model
def base_tensors(names: list[str], rows: int = 8, cols: int = 64) -> dict[str, torch.Tensor]:
    """Deterministic bf16 tensors (one row = 2 * ``cols`` bytes); one fp32 norm for variety."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name in names:
        dtype = torch.float32 if name.endswith("norm.weight") else torch.bfloat16
        out[name] = torch.randn(rows, cols, generator=g).to(dtype)
    return out


def model_at(
    base: dict[str, torch.Tensor], changes: dict[int, set[str]], step: int
) -> dict[str, torch.Tensor]:
    """The model after ``step`` steps: step ``s`` adds ``s`` to row ``s % rows`` of each
    tensor in ``changes[s]``."""
    out = {name: t.clone() for name, t in base.items()}
    for s in range(1, step + 1):
        for name in changes.get(s, set()):
            t = out[name]
            t[s % t.shape[0]] += float(s)
    return out


def write_base(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    return make_checkpoint(directory, tensors, shards=2)


def assert_checkpoint_equals(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of a local checkpoint has exactly the expected bytes."""
    got = checkpoint_bytes(directory)
    assert set(got) == set(expected)
    wrong = sorted(n for n in expected if got[n] != raw_bytes(expected[n]))
    assert not wrong, f"tensors with wrong bytes: {wrong}"
