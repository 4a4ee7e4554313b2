"""What ``deltastore serve`` logs: every refusal and failure at WARNING with the request's
target and reason (visible at the default level), a pull that succeeded at INFO."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deltastore.pull.server import ServerConfig
from tests.pull.helpers import many_tensors, publish_versions, write_checkpoint
from tests.pull.serving import running_server


def _post(url: str, path: str, body: object) -> int:
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "deltastore.serve" and r.levelno == level
    ]


def test_refusals_and_failures_are_logged_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = many_tensors(4, seed=3, elements=256)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 1, seed=4)
    store, host = str(published.store_dir), str(tmp_path / "host")
    config = ServerConfig(base_dir=str(tmp_path / "base"), allow=(str(tmp_path),))
    caplog.set_level(logging.INFO, logger="deltastore.serve")
    with running_server(config) as running:
        pull = {"local_checkpoint_dir": host, "source_dir": store}
        assert _post(running.url, "/pull_weights", {**pull, "target_version": 1}) == 200
        assert _post(running.url, "/pull_weights", {**pull, "target_version": 9}) == 400
        outside = {**pull, "local_checkpoint_dir": "/elsewhere/host", "target_version": 1}
        assert _post(running.url, "/pull_weights", outside) == 403
        assert _post(running.url, "/pull_weights", {"local_checkpoint_dir": host}) == 400
        assert _post(running.url, "/no_such_route", {}) == 404

    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 4, warnings
    failed, refused, malformed, missing = warnings
    assert failed.startswith("POST /pull_weights") and f"{host} v000009 from {store}" in failed
    assert "-> 400" in failed and "weight_v000009" in failed
    assert "-> 403" in refused and "/elsewhere/host" in refused
    assert "-> 400" in malformed and "source_dir" in malformed
    assert missing.startswith("POST /no_such_route -> 404")
    infos = _records(caplog, logging.INFO)
    assert len(infos) == 1 and f"{host} v000001 from {store}" in infos[0] and "-> 200" in infos[0]
