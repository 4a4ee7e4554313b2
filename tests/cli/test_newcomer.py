"""A newcomer's frictions with the ``deltastore`` command, each as a real subprocess.

Typos and bad paths fail in one line with rc 1; --json prints exactly one object; the common
flags work after the subcommand; a missing optional extra is named in one line.
"""

from __future__ import annotations

import itertools
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import _model, _step, deltastore
from tests.conftest import make_checkpoint

# Slow: every test runs the CLI in fresh processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a process where ``import module`` fails, as without its extra."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from deltastore.cli import main\n"
        f"raise SystemExit(main({list(args)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def published3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Published once per module through the CLI (three processes): the checkpoints and the
    store each test gets a copy of."""
    root = tmp_path_factory.mktemp("published3")
    states = [_model(0)]
    for k in (1, 2, 3):
        states.append(_step(states[-1], k))
    ckpts = [make_checkpoint(root / f"ckpt{i}", s) for i, s in enumerate(states)]
    for prev, new in itertools.pairwise(ckpts):
        deltastore(
            "publish", "--store", str(root / "store"), "--prev", str(prev), "--new", str(new)
        )
    return root


@pytest.fixture
def store3(tmp_path: Path, published3: Path) -> tuple[str, list[Path]]:
    """A store with three chained deltas (v1..v3) and the four checkpoints behind them: this
    test's own copy, which it may change."""
    run = shutil.copytree(published3, tmp_path / "run")
    return str(run / "store"), [run / f"ckpt{i}" for i in range(4)]


def test_ls_of_a_missing_path_or_a_model_dir_fails(tmp_path: Path, store3) -> None:  # type: ignore[no-untyped-def]
    _, ckpts = store3
    _one_line_error(deltastore("ls", str(tmp_path / "no-such-store"), check=False), "no store at")
    missing = deltastore("ls", str(tmp_path / "no-such-store"), "--json", check=False)
    assert missing.returncode == 1 and json.loads(missing.stdout)["ok"] is False
    _one_line_error(deltastore("ls", str(ckpts[0]), check=False), "holds a checkpoint")


def test_ls_lists_healthy_versions_beside_a_corrupt_index(store3) -> None:  # type: ignore[no-untyped-def]
    store, _ = store3
    index = Path(store) / "weight_v000002" / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:20])  # truncated mid-write by a broken copy
    proc = deltastore("ls", store, "--json")
    rows = {r["version"]: r for r in json.loads(proc.stdout)["versions"]}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["kind"] == rows[3]["kind"] == "delta"
    assert rows[2]["kind"] == "corrupt" and "weight_v000002" in rows[2]["error"]
    assert "weight_v000002" in proc.stderr and "warning" in proc.stderr
    table = deltastore("ls", store)
    assert "corrupt index" in table.stdout and "000003" in table.stdout


def test_common_flags_after_the_subcommand_version_and_did_you_mean(tmp_path: Path) -> None:
    args = (
        "--store",
        str(tmp_path / "s"),
        "--local",
        str(tmp_path / "h"),
        "--base",
        str(tmp_path / "b"),
        "--version",
        "3",
    )
    debug = deltastore("pull", *args, "--debug", check=False)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    plain = deltastore("pull", *args, "-v", check=False)
    _one_line_error(plain, str(tmp_path / "b"))  # the missing --base, checked first
    version = deltastore("--version")
    assert version.stdout.startswith("deltastore ") and version.stdout.split()[1][0].isdigit()
    typo = deltastore("lss", str(tmp_path), check=False)
    assert typo.returncode == 2 and "did you mean 'ls'" in typo.stderr


def test_missing_extras_are_named_in_one_line(tmp_path: Path, store3) -> None:  # type: ignore[no-untyped-def]
    store, _ = store3
    no_moto = _without("moto", "demo", "--backend", "s3", "--size", "1", "--steps", "1")
    _one_line_error(no_moto, "pip install 'deltastore[emulators]'")
    png = str(tmp_path / "h.png")
    no_plot = _without("matplotlib", "inspect", store, "--history", "--plot", png)
    _one_line_error(no_plot, "pip install 'deltastore[plot]'")
    assert not (tmp_path / "h.png").exists()


def test_every_result_prints_one_json_object(tmp_path: Path, store3) -> None:  # type: ignore[no-untyped-def]
    store, ckpts = store3
    base, host = str(ckpts[0]), str(tmp_path / "host")

    def one(*args: str) -> dict[str, object]:
        proc = deltastore(*args, "--json")
        assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
        out = json.loads(proc.stdout)
        assert out["ok"] is True
        return out

    pulled = one("pull", "--store", store, "--local", host, "--base", base, "--version", "latest")
    assert pulled["version"] == 3 and pulled["action"] in ("reseeded", "applied")
    assert one("verify", "--store", store, "--local", host, "--base", base)["version"] == 3
    assert [r["version"] for r in one("ls", store)["versions"]] == [1, 2, 3]
    assert one("inspect", store, "latest")["version"] == 3
    pruned = one("prune", store, "--keep", "1")
    assert pruned["dry_run"] is True and pruned["lines"]
    step = make_checkpoint(tmp_path / "ckpt4", _step(_model(0), 0))
    published = one("publish", "--store", store, "--prev", str(ckpts[3]), "--new", str(step))
    assert published["version"] == 4 and 0 < float(published["density"]) < 1  # type: ignore[arg-type]
    bench = one("bench", "--size", "1", "--steps", "1")
    per_step = bench["per_step"]
    assert 0 < per_step["delta"]["wire"] < per_step["full"]["wire"]  # type: ignore[index]


def test_inspect_latest_shows_real_dtype_and_shape_and_plots(tmp_path: Path, store3) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    store, ckpts = store3
    latest = deltastore("inspect", store, "latest", "--base", str(ckpts[0])).stdout
    assert latest == deltastore("inspect", store, "3", "--base", str(ckpts[0])).stdout
    assert "weight_v000003" in latest
    # The payload is stored as U8 bytes; the model's own dtype and shape come from --base.
    assert "BF16[32, 32]" in latest and "F32[32]" in latest
    info = json.loads(deltastore("inspect", store, "3", "--base", str(ckpts[0]), "--json").stdout)
    (tensors,) = info["shards"].values()
    weight = tensors["layer.0.weight"]
    assert weight["model_dtype"] == "BF16" and weight["model_shape"] == [32, 32]
    assert 0 < weight["density"] <= 6 / (32 * 32 * 2)  # 3 elements changed: ≤ 6 bytes of 2048
    png = tmp_path / "v3.png"
    deltastore("inspect", store, "3", "--plot", str(png))
    history = tmp_path / "history.png"
    deltastore("inspect", store, "--history", "--plot", str(history))
    for path in (png, history):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_prune_prints_the_report(store3) -> None:  # type: ignore[no-untyped-def]
    store, _ = store3
    out = deltastore("prune", store, "--keep", "1").stdout
    assert "dry run" in out
    for version in ("v000001", "v000002", "v000003"):  # v3's chain needs all three
        assert version in out


def test_progress_on_a_terminal_only(store3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, ckpts = store3
    args = ["verify", "--store", store, "--local", str(tmp_path / "h"), "--base", str(ckpts[0])]
    deltastore("pull", *args[1:], "--version", "3")

    def stderr_on_tty(*extra: str) -> str:
        controller, terminal = pty.openpty()
        proc = subprocess.run(
            [sys.executable, "-m", "deltastore.cli", *args, *extra],
            stdout=subprocess.PIPE,
            stderr=terminal,
            timeout=120,
        )
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(controller)
        assert proc.returncode == 0
        return b"".join(chunks).decode(errors="replace")

    assert "hashing every tensor" in stderr_on_tty()
    assert "hashing every tensor" not in stderr_on_tty("--quiet")
    assert "hashing" not in deltastore(*args).stderr  # not a terminal: no progress


def test_demo_size_means_what_it_says(tmp_path: Path) -> None:
    from deltastore.cli.demo import layer_shapes

    for size_mb in (1, 8, 64, 256):
        total = sum(2 * rows * cols for _, (rows, cols) in layer_shapes(size_mb))
        assert abs(total / 1e6 - size_mb) <= 0.16 * size_mb, (size_mb, total)
    out = deltastore("demo", "--size", "8", "--steps", "1", "--workdir", str(tmp_path / "d"))
    model_mb = float(out.stdout.split(" MB")[0].rsplit(" ", 1)[1])
    assert 7 <= model_mb <= 9.5, out.stdout


def test_a_second_demo_in_the_same_workdir_is_told_what_to_pass(tmp_path: Path) -> None:
    args = ("demo", "--size", "1", "--steps", "1", "--workdir", str(tmp_path / "d"))
    deltastore(*args)
    again = deltastore(*args, check=False)
    _one_line_error(again, "already holds versions", "a new --workdir")
    assert "resume=True" not in again.stderr  # (the Python API's words, not the command's)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(store3, json_flag: list[str]) -> None:  # type: ignore[no-untyped-def]
    """`deltastore ls STORE --json | head -1`: the pipe closes before the output is written."""
    store, _ = store3
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltastore.cli", "ls", store, *json_flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before a byte was read
    stderr = proc.stderr.read()
    assert proc.wait(timeout=180) == 1
    assert stderr == "", stderr


@pytest.mark.parametrize(
    "command",
    [
        ["pull", "--version", "latest"],
        ["pull", "--version", "3"],
        ["verify", "--version", "3"],
        ["ls"],
        ["inspect", "3"],
        ["prune", "--keep", "2"],
        ["replicate"],
    ],
    ids=lambda c: "-".join(c),
)
def test_a_mistyped_store_gets_one_message_everywhere(
    tmp_path: Path, store3, command: list[str]
) -> None:  # type: ignore[no-untyped-def]
    _, ckpts = store3
    typo, host = str(tmp_path / "sotre"), tmp_path / "host"
    name, *rest = command
    if name in ("pull", "verify"):
        args = [name, "--store", typo, "--local", str(host), "--base", str(ckpts[0]), *rest]
    elif name == "replicate":
        args = [name, typo, str(tmp_path / "replica")]
    else:
        args = [name, typo, *rest]
    _one_line_error(
        deltastore(*args, check=False),
        f"no store at {typo}: nothing was ever published there; check the store URL",
    )
    assert not host.exists(), "nothing is created on the host for a pull that cannot run"


def test_a_pull_with_a_missing_base_creates_nothing_on_the_host(tmp_path: Path, store3) -> None:  # type: ignore[no-untyped-def]
    store, _ = store3
    host = tmp_path / "host"
    proc = deltastore(
        "pull",
        "--store",
        store,
        "--local",
        str(host),
        "--base",
        str(tmp_path / "no-base"),
        "--version",
        "3",
        check=False,
    )
    _one_line_error(proc, "no-base does not exist")
    assert not host.exists()
