"""``deltastore emulate s3|gcs``: the printed export lines are all another shell needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import _model, _step
from tests.conftest import make_checkpoint

# Slow: starts the emulators and the CLI in fresh processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_emulate_prints_the_environment_and_stops_on_ctrl_c(tmp_path: Path, kind: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltastore.cli", "emulate", kind, "--bucket", "newcomer"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("export "):
                key, _, value = line[len("export ") :].strip().partition("=")
                env[key] = value
            if "Ctrl-C" in line:
                break
        scheme = "s3" if kind == "s3" else "gs"
        url = f"{scheme}://newcomer/run1"
        # Only the printed lines: no storage options, no credentials of our own.
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GCS"))}
        child_env.pop("STORAGE_EMULATOR_HOST", None)
        child_env.update(env)
        base = make_checkpoint(tmp_path / "base", _model(0))
        new = make_checkpoint(tmp_path / "new", _step(_model(0), 1))
        for args in (
            ["publish", "--store", url, "--prev", str(base), "--new", str(new)],
            ["ls", url, "--json"],
        ):
            command = [sys.executable, "-m", "deltastore.cli", *args]
            done = subprocess.run(
                command, capture_output=True, text=True, env=child_env, timeout=180
            )
            assert done.returncode == 0, done.stderr
            assert "WARNING" not in done.stderr, done.stderr  # e.g. gcsfs's bucket-type probe
        assert [r["version"] for r in json.loads(done.stdout)["versions"]] == [1]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped" in err and "Traceback" not in err
