"""The ``deltastore`` command, run as a real subprocess on real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import checkpoint_bytes, make_checkpoint

# Slow: every test runs the CLI in fresh processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def deltastore(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI entry point (``python -m deltastore.cli``) and capture its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "deltastore.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "200"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"deltastore {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(32, generator=g),
        "norm.weight": torch.ones(32, dtype=torch.float16),
    }


def _step(tensors: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    out = {name: t.clone() for name, t in tensors.items()}
    out["layer.0.weight"].view(-1)[k : k + 3] += 1
    out["layer.0.bias"][k] -= 0.5
    return out


@pytest.fixture
def checkpoints(tmp_path: Path) -> list[Path]:
    """Three successive checkpoints: base (v0), v1, v2."""
    states = [_model(0)]
    for k in (1, 2):
        states.append(_step(states[-1], k))
    return [make_checkpoint(tmp_path / f"ckpt{i}", s) for i, s in enumerate(states)]


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_publish_pull_ls_verify(tmp_path: Path, checkpoints: list[Path], encoding: str) -> None:
    store = str(tmp_path / "store")
    base, v1, v2 = (str(c) for c in checkpoints)
    out = deltastore(
        "publish", "--store", store, "--prev", base, "--new", v1, "--encoding", encoding
    )
    assert "weight_v000001" in out.stdout
    deltastore(
        "publish",
        "--store",
        store,
        "--prev",
        v1,
        "--new",
        v2,
        "--encoding",
        encoding,
        "--checksum",
        "blake3",
    )

    listing = json.loads(deltastore("ls", store, "--json").stdout)["versions"]
    assert [row["version"] for row in listing] == [1, 2]
    assert [row["base_version"] for row in listing] == [0, 1]
    assert {row["kind"] for row in listing} == {"delta"}
    assert {row["encoding"] for row in listing} == {encoding}
    assert all(row["tensors"] == 2 and row["wire_bytes"] > 0 for row in listing)
    assert "000002" in deltastore("ls", store).stdout

    local = tmp_path / "host"
    deltastore(
        "pull", "--store", store, "--local", str(local), "--base", base, "--version", "latest"
    )
    assert checkpoint_bytes(local) == checkpoint_bytes(v2)
    assert (
        deltastore("verify", "--store", store, "--local", str(local), "--base", base).returncode
        == 0
    )

    # The local bytes are at v2, so verifying them against v1 must fail, by digest.
    bad = deltastore(
        "verify",
        "--store",
        store,
        "--local",
        str(local),
        "--base",
        base,
        "--version",
        "1",
        check=False,
    )
    assert bad.returncode != 0 and "do not match" in bad.stderr

    deltastore("pull", "--store", store, "--local", str(local), "--base", base, "--version", "1")
    assert checkpoint_bytes(local) == checkpoint_bytes(v1)


def test_publish_refuses_prev_that_contradicts_the_chain(
    tmp_path: Path, checkpoints: list[Path]
) -> None:
    store = str(tmp_path / "store")
    base, v1, v2 = (str(c) for c in checkpoints)
    deltastore("publish", "--store", store, "--prev", base, "--new", v1)
    # PREV must be the state of v1; passing the base again would corrupt v2 and later versions.
    proc = deltastore("publish", "--store", store, "--prev", base, "--new", v2, check=False)
    assert proc.returncode == 1
    assert "weight_v000001" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert json.loads(deltastore("ls", store, "--json").stdout)["versions"][-1]["version"] == 1


def test_pull_creates_local_dir_and_reseeds_dir_without_state(
    tmp_path: Path, checkpoints: list[Path]
) -> None:
    store = str(tmp_path / "store")
    base, v1, _ = (str(c) for c in checkpoints)
    deltastore("publish", "--store", store, "--prev", base, "--new", v1)
    # A directory with weights but no state file holds "nothing": it is reseeded from the base.
    local = tmp_path / "host"
    shutil.copytree(v1, local)
    with open(next(local.glob("*.safetensors")), "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x7f")
    deltastore("pull", "--store", store, "--local", str(local), "--base", base, "--version", "1")
    assert checkpoint_bytes(local) == checkpoint_bytes(v1)


def test_errors_are_one_line_unless_debug(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    proc = deltastore(
        "pull",
        "--store",
        str(tmp_path / "store"),
        "--local",
        str(tmp_path / "h"),
        "--base",
        missing,
        "--version",
        "3",
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("deltastore pull: error:") and missing in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    store, host = str(tmp_path / "store"), str(tmp_path / "h")
    debug = deltastore(
        "--debug",
        "pull",
        "--store",
        store,
        "--local",
        host,
        "--base",
        missing,
        "--version",
        "3",
        check=False,
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr

    bad_encoding = deltastore(
        "publish", "--store", "x", "--prev", "a", "--new", "b", "--encoding", "lz4", check=False
    )
    assert bad_encoding.returncode == 2 and "invalid choice" in bad_encoding.stderr


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    proc = deltastore("demo", "--size", "8", "--steps", "2", "--workdir", str(tmp_path / "demo"))
    assert "000002" in proc.stdout and "verified on both hosts" in proc.stdout
    rows = json.loads(deltastore("ls", str(tmp_path / "demo" / "store"), "--json").stdout)
    assert [r["version"] for r in rows["versions"]] == [1, 2]
    # Every step of the demo changes a small, non-zero fraction of the model.
    assert all(r["wire_bytes"] > 0 for r in rows["versions"])


def test_inspect_shows_payloads_and_digests(tmp_path: Path, checkpoints: list[Path]) -> None:
    store = str(tmp_path / "store")
    base, v1, _ = (str(c) for c in checkpoints)
    deltastore("publish", "--store", store, "--prev", base, "--new", v1, "--checksum", "adler32")
    info = json.loads(deltastore("inspect", store, "1", "--json").stdout)
    assert info["kind"] == "delta" and info["checksum"] == "adler32"
    (tensors,) = info["shards"].values()
    assert set(tensors) == {"layer.0.weight", "layer.0.bias"}
    assert all(t["dtype"] == "U8" and len(t["digest"]) == 8 for t in tensors.values())
    missing = deltastore("inspect", store, "9", check=False)
    assert missing.returncode == 1 and "weight_v000009" in missing.stderr


def test_bench_prints_ratios(tmp_path: Path) -> None:
    out = deltastore("bench", "--size", "4", "--steps", "1").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    delta_wire, full_wire, ratio = (float(x) for x in rows["wire"][2:5])
    assert 0 < delta_wire < full_wire and abs(ratio - delta_wire / full_wire) < 1e-3


def test_publish_refuses_prev_with_tensors_the_full_version_lacks(tmp_path: Path) -> None:
    """After a full version, the chain records the complete tensor set: a PREV with a tensor
    outside it (another model) is refused, else a change to it would break every host's pull."""
    store = str(tmp_path / "store")
    states = [_model(0)]
    for k in (1, 2):
        states.append(_step(states[-1], k))
    base, v1 = (make_checkpoint(tmp_path / f"ckpt{i}", s) for i, s in enumerate(states[:2]))
    deltastore("publish", "--store", store, "--prev", str(base), "--new", str(v1), "--full")
    extra = torch.arange(16, dtype=torch.float32)
    prev = make_checkpoint(tmp_path / "prev", {**states[1], "lm_head.weight": extra})
    new = make_checkpoint(tmp_path / "new", {**states[2], "lm_head.weight": extra + 1})
    proc = deltastore(
        "publish", "--store", store, "--prev", str(prev), "--new", str(new), check=False
    )
    assert proc.returncode == 1, proc.stdout
    assert "lm_head.weight" in proc.stderr and "Traceback" not in proc.stderr
    assert [
        r["version"] for r in json.loads(deltastore("ls", store, "--json").stdout)["versions"]
    ] == [1]


def test_pull_latest_from_a_missing_store_is_an_error(
    tmp_path: Path, checkpoints: list[Path]
) -> None:
    base = str(checkpoints[0])
    local = tmp_path / "host"
    typo = str(tmp_path / "no-such-store")
    proc = deltastore(
        "pull",
        "--store",
        typo,
        "--local",
        str(local),
        "--base",
        base,
        "--version",
        "latest",
        check=False,
    )
    assert proc.returncode == 1 and "no store at" in proc.stderr
    assert not local.exists() or not list(local.glob("*.safetensors")), "the host was reseeded"


@pytest.mark.parametrize("backend", ["s3", "gcs", "memory"])
def test_demo_on_other_backends(tmp_path: Path, backend: str) -> None:
    """``--backend s3|gcs`` starts its own embedded emulator (no account, no docker)."""
    proc = deltastore(
        "demo",
        "--backend",
        backend,
        "--size",
        "4",
        "--steps",
        "1",
        "--workdir",
        str(tmp_path / "demo"),
    )
    assert "000001" in proc.stdout and "verified on both hosts" in proc.stdout
    assert ("s3://" in proc.stdout) == (backend == "s3")
    assert ("gs://" in proc.stdout) == (backend == "gcs")
    assert "WARNING" not in proc.stderr, proc.stderr  # gcsfs's bucket-type probe is off


def _bench_json(*args: str) -> dict:  # type: ignore[type-arg]
    out = deltastore("bench", "--model", "small", "--layers", "1", "--repeat", "1", "--json", *args)
    return json.loads(out.stdout)


def test_bench_json_has_paths_phases_and_targets() -> None:
    result = _bench_json("--density", "0.01")
    assert set(result["paths"]) == {"reference", "upstream", "xor", "sparse-v2", "auto"}
    for row in result["paths"].values():
        assert row["wire_bytes"] > 0 and row["publish_s"] > 0 and row["pull_s"] > 0
        assert {"wire_pct_of_full", "publish_vs_reference", "pull_vs_full_copy"} <= set(row)
    assert {"encode_s", "diff_s", "write_s"} <= set(result["paths"]["auto"]["phase_s"])
    assert result["paths"]["reference"]["wire_vs_reference"] == 1.0
    targets = {t["target"]: t for t in result["targets"]}
    assert set(targets) == {
        "wire_vs_reference",
        "publish_vs_reference",
        "pull_vs_reference",
        "pull_vs_upstream",
    }
    # 'upstream' is the reference pull without the final msync, as the engine readers apply.
    assert result["paths"]["upstream"]["wire_bytes"] == result["paths"]["reference"]["wire_bytes"]
    assert all(t["encoding"] == "auto" for t in targets.values())
    for target in targets.values():
        assert target["met"] == (target["measured"] <= target["at_most"])


def test_bench_density_sets_the_share_of_changed_elements() -> None:
    sparse = _bench_json("--density", "0.002", "--encodings", "xor")
    dense = _bench_json("--density", "0.05", "--encodings", "xor")
    # bf16 ±1 ulp changes one or two bytes of an element: a byte density of 1/2 to 1 of it.
    assert 0.0005 < sparse["model"]["density_bytes"] < 0.003
    assert 0.0125 < dense["model"]["density_bytes"] < 0.06
    assert dense["paths"]["xor"]["wire_bytes"] > 3 * sparse["paths"]["xor"]["wire_bytes"]
