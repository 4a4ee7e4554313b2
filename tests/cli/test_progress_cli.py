"""The CLI's byte progress: a bar with bytes on a terminal (stderr), nothing otherwise.

Each command runs as a real subprocess whose stderr is a pseudo-terminal (``pty``), as in an
interactive shell; stdout is a pipe. With ``--json``, ``--quiet`` or a stderr that is not a
terminal, stderr stays empty.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

import deltastore as ds
from tests.conftest import make_checkpoint

# Slow: every test runs the CLI in fresh processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BYTES_OF_TOTAL = re.compile(r"\d+(\.\d+)?/\d+(\.\d+)? (bytes|kB|MB|GB)")


def run_on_tty(*args: str) -> tuple[int, str, str]:
    """Run ``deltastore ARGS`` with stderr on a pseudo-terminal; (rc, stdout, stderr text)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltastore.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "200"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    stdout, _ = proc.communicate(timeout=180)
    os.close(master)
    return proc.returncode, stdout.decode(), ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def run_piped(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltastore.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base (v0), the next checkpoint and a store holding v1, published once per module
    through the CLI; each test gets a copy."""
    root = tmp_path_factory.mktemp("published")
    base = make_checkpoint(root / "base", _model(0))
    step = {n: t.clone() for n, t in _model(0).items()}
    for t in step.values():
        t.view(-1)[::97] += 1
    new = make_checkpoint(root / "new", step)
    rc = run_piped(
        "publish", "--store", str(root / "store"), "--prev", str(base), "--new", str(new)
    )
    assert rc.returncode == 0, rc.stderr
    return root


@pytest.fixture
def store_and_host(tmp_path: Path, published: Path) -> tuple[Path, Path, Path, Path]:
    """A base (v0), the next checkpoint, a store holding v1, and a host pulled to v0 (this
    test's own copies)."""
    run = shutil.copytree(published, tmp_path / "run")
    base, new, store, host = run / "base", run / "new", run / "store", tmp_path / "host"
    ds.pull_weights(host, ds.VersionStore(store), 0, base_dir=base)
    return base, new, store, host


def _bar_phases(stderr: str, what: str) -> set[str]:
    """Phases shown in bars of ``what`` that also show bytes done of a total."""
    return {
        m.group(1)
        for line in re.split(r"[\r\n]", stderr)
        if BYTES_OF_TOTAL.search(line)
        for m in [re.search(re.escape(what) + r": (\w+) ", line)]
        if m
    }


def test_pull_verify_publish_prune_show_byte_bars_on_a_terminal(store_and_host) -> None:
    base, new, store, host = store_and_host
    at = ("--store", str(store), "--local", str(host), "--base", str(base))
    rc, out, err = run_on_tty("pull", *at, "--version", "1")
    assert rc == 0 and "applied" in out
    assert _bar_phases(err, f"pulling weight_v000001 into {host}") == {"apply"}, err

    rc, _, err = run_on_tty("verify", *at)
    assert rc == 0
    assert "verify" in _bar_phases(err, f"hashing every tensor of {host}"), err

    publish = ("publish", "--store", str(store), "--prev", str(new), "--new", str(base))
    rc, _, err = run_on_tty(*publish, "--full")
    assert rc == 0
    assert _bar_phases(err, f"publishing weight_v000002 to {store}") == {"diff", "write"}, err
    assert _bar_phases(err, f"seeding from --prev {new}") == {"seed"}, err

    rc, out, err = run_on_tty("prune", str(store), "--keep", "1", "--grace", "0", "--yes")
    assert rc == 0 and "v000001" in out
    assert _bar_phases(err, f"pruning {store}") == {"prune"}, err


def test_bench_shows_a_byte_bar_on_a_terminal() -> None:
    rc, out, err = run_on_tty("bench", "--size", "1", "--repeat", "1", "--encodings", "xor")
    assert rc == 0 and "wire" in out
    assert _bar_phases(err, "bench synthetic: reference, xor, full copy") == {"runs"}, err


@pytest.mark.parametrize("flag", ["--json", "--quiet"])
def test_json_and_quiet_keep_the_terminal_clean(store_and_host, flag: str) -> None:
    base, _, store, host = store_and_host
    rc, out, err = run_on_tty(
        "pull",
        "--store",
        str(store),
        "--local",
        str(host),
        "--base",
        str(base),
        "--version",
        "1",
        flag,
    )
    assert rc == 0 and out
    assert err.strip() == ""


def test_no_terminal_no_progress(store_and_host) -> None:
    base, _, store, host = store_and_host
    at = ("--store", str(store), "--local", str(host), "--base", str(base))
    for args in (
        ("pull", *at, "--version", "1"),
        ("verify", *at),
        ("prune", str(store), "--keep", "1", "--grace", "0", "--yes"),
    ):
        proc = run_piped(*args)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
