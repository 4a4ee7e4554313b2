"""``deltastore prune``: a dry run by default, --yes to apply, options and JSON output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deltastore.cli import main
from deltastore.storage import VersionStore
from deltastore.testing.store_tests import write_version


def fill(store: VersionStore) -> None:
    write_version(store, 1)
    write_version(store, 2, base=1)
    write_version(store, 3)
    write_version(store, 4, base=3)
    write_version(store, 5, commit=False)  # a crashed writer's leftovers


def test_prune_is_a_dry_run_unless_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = VersionStore(tmp_path / "store")
    fill(store)
    assert main(["prune", str(tmp_path / "store"), "--keep", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out
    assert "would unpublish (2): v000001, v000002" in out
    assert "would fence stale uncommitted (1): v000005" in out
    assert "--yes" in out
    assert store.versions() == [1, 2, 3, 4]

    assert main(["prune", str(tmp_path / "store"), "--keep", "1", "--grace", "0", "--yes"]) == 0
    assert "did unpublish (2)" in capsys.readouterr().out
    assert store.versions() == [3, 4]
    assert store.list_files(5) == []


def test_prune_keeps_grace_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = VersionStore(tmp_path / "store")
    fill(store)
    assert main(["prune", str(tmp_path / "store"), "--keep", "1", "--yes", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unpublish"] == [1, 2] and report["delete"] == [] and report["waiting"] == [5]
    assert store.versions() == [3, 4]
    assert store.list_files(1)  # unpublished, data kept for the grace period


def test_prune_refuses_keep_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(tmp_path), "--keep", "0"]) == 1
    assert "at least the latest version must be kept" in capsys.readouterr().err


def test_prune_on_s3_with_storage_options(
    s3_server: Any, s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = s3_server.storage_options
    fill(VersionStore(s3_url, options))
    flags = [
        "-o",
        f"key={options['key']}",
        "-o",
        f"secret={options['secret']}",
        "-o",
        f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
        "-o",
        "client_kwargs.region_name=us-east-1",
    ]
    assert main(["prune", s3_url, "--keep", "2", "--grace", "0", "--yes", *flags]) == 0
    assert "did unpublish (2): v000001, v000002" in capsys.readouterr().out
    assert VersionStore(s3_url, options).versions() == [3, 4]
