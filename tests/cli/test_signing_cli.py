"""Signed versions through the CLI: keygen → publish --sign-key → pull --trust → verify
--trust, rotation with two --trust files, and ``serve --trust`` applying its keys to every
request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltastore import VersionStore
from deltastore.trust import SIGNATURE_KEY
from tests.cli.test_cli import _model, _step, deltastore
from tests.conftest import checkpoint_bytes, make_checkpoint
from tests.pull.test_server import http, start_server, stop_server

# Slow: every test runs the CLI in fresh processes.
pytestmark = pytest.mark.slow


def _checkpoints(tmp_path: Path, count: int) -> list[str]:
    states = [_model(0)]
    for k in range(1, count + 1):
        states.append(_step(states[-1], k))
    return [str(make_checkpoint(tmp_path / f"ckpt{i}", s)) for i, s in enumerate(states)]


def test_keygen_publish_pull_verify_round_trip(tmp_path: Path) -> None:
    ckpt = _checkpoints(tmp_path, 3)
    store = str(tmp_path / "store")
    (tmp_path / "keys").mkdir()
    old, new = str(tmp_path / "keys" / "old"), str(tmp_path / "keys" / "new")
    deltastore("keygen", old)
    deltastore("keygen", new)
    deltastore(
        "publish", "--store", store, "--prev", ckpt[0], "--new", ckpt[1], "--sign-key", old + ".key"
    )
    deltastore(
        "publish", "--store", store, "--prev", ckpt[1], "--new", ckpt[2], "--sign-key", new + ".key"
    )
    deltastore("publish", "--store", store, "--prev", ckpt[2], "--new", ckpt[3])  # unsigned
    assert SIGNATURE_KEY in VersionStore(store).index(2).extra
    host = str(tmp_path / "host")
    pull = ["pull", "--store", store, "--local", host, "--base", ckpt[0]]
    refused = deltastore(*pull, "--version", "2", "--trust", new + ".pub", check=False)
    assert refused.returncode != 0 and "weight_v000001 is signed by key" in refused.stderr
    assert "not trusted" in refused.stderr and "Traceback" not in refused.stderr
    deltastore(*pull, "--version", "2", "--trust", old + ".pub", "--trust", new + ".pub")
    assert checkpoint_bytes(host) == checkpoint_bytes(ckpt[2])
    verify = ["verify", "--store", store, "--local", host, "--base", ckpt[0], "--json"]
    out = deltastore(*verify, "--trust", old + ".pub", "--trust", new + ".pub")
    assert json.loads(out.stdout)["version"] == 2 and json.loads(out.stdout)["matches"]
    unsigned = deltastore(*pull, "--version", "3", "--trust", new + ".pub", check=False)
    assert unsigned.returncode != 0 and "not signed" in unsigned.stderr
    assert checkpoint_bytes(host) == checkpoint_bytes(ckpt[2])
    deltastore(*pull, "--version", "3")  # without --trust, unsigned versions pull as before
    assert checkpoint_bytes(host) == checkpoint_bytes(ckpt[3])


def test_serve_trust_applies_to_every_request(tmp_path: Path) -> None:
    ckpt = _checkpoints(tmp_path, 2)
    allowed = tmp_path / "allowed"
    store = str(allowed / "store")
    (tmp_path / "keys").mkdir()
    key = str(tmp_path / "keys" / "run")
    deltastore("keygen", key)
    deltastore(
        "publish", "--store", store, "--prev", ckpt[0], "--new", ckpt[1], "--sign-key", key + ".key"
    )
    deltastore("publish", "--store", store, "--prev", ckpt[1], "--new", ckpt[2])  # unsigned
    server = start_server("--base", ckpt[0], "--allow", str(allowed), "--trust", key + ".pub")
    try:
        host = str(allowed / "host")
        body = {"local_checkpoint_dir": host, "source_dir": store}
        status, reply = http(
            "POST", server.url + "/pull_weights", {**body, "target_version": 1}, token=None
        )
        assert status == 200 and reply["success"], reply
        status, reply = http(
            "POST", server.url + "/pull_weights", {**body, "target_version": 2}, token=None
        )
        assert not reply["success"] and "not signed" in str(reply["message"]), reply
        assert checkpoint_bytes(host) == checkpoint_bytes(ckpt[1])
    finally:
        stop_server(server)


def test_keygen_creates_the_key_dir_and_an_unsigned_publish_warns_or_is_refused(
    tmp_path: Path,
) -> None:
    """docs/signing.md's `deltastore keygen keys/run1` in a dir without keys/; then a publish
    without --sign-key onto the signed store warns, and with --require-signed is refused."""
    ckpt = _checkpoints(tmp_path, 3)
    store = str(tmp_path / "store")
    key = str(tmp_path / "keys" / "run1")  # keys/ does not exist
    deltastore("keygen", key)
    assert (tmp_path / "keys" / "run1.key").stat().st_mode & 0o777 == 0o600
    deltastore(
        "publish", "--store", store, "--prev", ckpt[0], "--new", ckpt[1], "--sign-key", key + ".key"
    )
    refused = deltastore(
        "publish",
        "--store",
        store,
        "--prev",
        ckpt[1],
        "--new",
        ckpt[2],
        "--require-signed",
        check=False,
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "weight_v000001 in" in refused.stderr
    assert "is signed but this publisher" in refused.stderr
    assert VersionStore(store).versions() == [1], "nothing was published"
    warned = deltastore("publish", "--store", store, "--prev", ckpt[1], "--new", ckpt[2])
    assert "is signed but this publisher has no signing key" in warned.stderr
    assert VersionStore(store).versions() == [1, 2]
    signed = deltastore(
        "publish",
        "--store",
        store,
        "--prev",
        ckpt[2],
        "--new",
        ckpt[3],
        "--sign-key",
        key + ".key",
        "--require-signed",
    )
    assert "is signed but" not in signed.stderr
