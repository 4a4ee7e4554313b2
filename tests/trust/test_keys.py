"""Key files: ``deltastore keygen``, modes, wrong files, and the missing optional extra."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from deltastore.errors import ConfigError
from deltastore.trust import (
    InsecureKeyFileWarning,
    as_signing_key,
    as_trusted_keys,
    generate_keypair,
    key_id_of,
    load_private_key,
    load_public_key,
)


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generate_writes_a_private_0600_and_a_public_pem(tmp_path: Path):
    old_umask = os.umask(0)  # even with a permissive umask the private key is 0600
    try:
        files = generate_keypair(tmp_path / "run1")
    finally:
        os.umask(old_umask)
    assert files.private_path == str(tmp_path / "run1.key")
    assert mode(files.private_path) == 0o600
    assert mode(files.public_path) == 0o644
    assert Path(files.private_path).read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert Path(files.public_path).read_text().startswith("-----BEGIN PUBLIC KEY-----")
    private, public = load_private_key(files.private_path), load_public_key(files.public_path)
    assert private.key_id == public.key_id == files.key_id
    assert len(files.key_id) == 16 and int(files.key_id, 16) >= 0
    assert private.trusted().key_id == public.key_id
    assert files.key_id == key_id_of(
        bytes(public.public.public_bytes_raw())  # the raw 32-byte key
    )
    with pytest.raises(ConfigError, match="exists"):
        generate_keypair(tmp_path / "run1")
    assert generate_keypair(tmp_path / "run2").key_id != files.key_id


def test_wrong_files_are_clear_errors(tmp_path: Path):
    files = generate_keypair(tmp_path / "k")
    with pytest.raises(ConfigError, match="is a public key"):
        load_private_key(files.public_path)
    with pytest.raises(ConfigError, match="is a private key"):
        load_public_key(files.private_path)
    with pytest.raises(ConfigError, match=r"does not exist.*keygen"):
        load_public_key(tmp_path / "missing.pub")
    (tmp_path / "junk.pub").write_text("not a key\n")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_public_key(tmp_path / "junk.pub")
    junk_key = tmp_path / "junk.key"
    junk_key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    junk_key.chmod(0o600)
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        load_private_key(junk_key)
    with pytest.raises(ConfigError, match="trusted_keys is empty"):
        as_trusted_keys([])
    loaded = as_trusted_keys([files.public_path, load_public_key(files.public_path)])
    assert [k.key_id for k in loaded] == [files.key_id] * 2
    assert as_signing_key(files.private_path).key_id == files.key_id
    made = generate_keypair(tmp_path / "no" / "such" / "dir" / "k")  # the dirs are created
    assert os.stat(made.private_path).st_mode & 0o777 == 0o600
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="cannot create the key directory"):
        generate_keypair(tmp_path / "a-file" / "sub" / "k")


def test_a_private_key_readable_by_others_warns(tmp_path: Path):
    files = generate_keypair(tmp_path / "k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_private_key(files.private_path)  # 0600: no warning
    os.chmod(files.private_path, 0o644)
    with pytest.warns(InsecureKeyFileWarning, match="chmod 600"):
        assert load_private_key(files.private_path).key_id == files.key_id


def test_missing_extra_names_the_install_command(tmp_path: Path, monkeypatch):
    files = generate_keypair(tmp_path / "k")
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives", None)
    for call in (
        lambda: generate_keypair(tmp_path / "other"),
        lambda: load_public_key(files.public_path),
        lambda: load_private_key(files.private_path),
    ):
        with pytest.raises(ConfigError, match=r"pip install deltastore\[sign\]"):
            call()


def test_keygen_cli(tmp_path: Path):
    def keygen(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deltastore.cli", "keygen", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=os.getcwd()),
        )

    done = keygen(str(tmp_path / "run1"), "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["private_key"] == str(tmp_path / "run1.key")
    assert load_public_key(reply["public_key"]).key_id == reply["key_id"]
    assert mode(reply["private_key"]) == 0o600
    again = keygen(str(tmp_path / "run1"))
    assert again.returncode == 1 and "exists" in again.stderr and again.stderr.count("\n") == 1
    plain = keygen(str(tmp_path / "run2"))
    assert plain.returncode == 0 and "key id" in plain.stdout
