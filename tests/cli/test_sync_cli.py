"""``deltastore sync`` against the stand-in sglang server (tests/engines/standin.py): the
one-line and ``--json`` reports, the no-change skip with ``--from``, exit 1 when the engine is
left paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltastore.cli import main
from tests.engines.standin import SglangStandIn
from tests.engines.test_sync_sglang import Run
from tests.pull.serving import serving


def test_sync_reports_skips_and_fails_loud(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = Run(tmp_path)
    engine = SglangStandIn(run.base_dir)
    with serving(engine.app()) as url:
        common = ["sync", "--engine", "sglang", "--url", url, "--store", str(run.store_dir)]
        common += ["--local", str(tmp_path / "ckpt")]
        assert main([*common, "--version", "2", "--from", "0", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["version"] == 2 and report["changed"]
        assert report["tensors_changed"] > 0 and report["paused_s"] > 0
        assert run.matches(engine.state.weights[0], 2)

        engine.state.calls.clear()
        assert main([*common, "--version", "3", "--from", "2"]) == 0
        assert "changes nothing" in capsys.readouterr().out
        assert engine.state.calls == ["/pull_weights"]

        engine.state.fail_reloads = 2
        assert main([*common, "--version", "latest", "--from", "3"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("deltastore sync: error:") and "LEFT PAUSED" in err
        assert engine.state.paused
