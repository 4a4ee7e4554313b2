"""A pull given trusted keys that finds an interrupted transition repairs it only from
versions the keys vouch for: the repair reads the store's shard headers (the digests it
verifies each tensor by), so a version replaced since the transition began is refused as the
catch-up would refuse it, not recorded as repaired."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltastore.errors import SignatureError
from deltastore.format.state import PendingTransition
from deltastore.pull import LocalCheckpoint
from deltastore.trust import SIGNATURE_KEY, generate_keypair
from tests.conftest import checkpoint_bytes
from tests.trust.test_signed_pull import expected, publish_run


def test_repair_with_trusted_keys_refuses_an_unsigned_version(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    key = generate_keypair(tmp_path / "keys" / "k1")
    run = publish_run(str(tmp_path / "store"), None, tmp_path, key.private_path, 2)
    host = tmp_path / "host"
    trust = [key.public_path]
    run.pull(host, 1, trust)
    # A crash right after the transition to v2 began: nothing of v2 written yet.
    stream = run.store.index(2).stream_id
    LocalCheckpoint(host).begin(PendingTransition(1, 2, stream, stream, [2]))
    run.edit_index(2, lambda meta: meta.pop(SIGNATURE_KEY))  # v2 republished unsigned
    with pytest.raises(SignatureError, match="not signed"):
        run.pull(host, 2, trust)
    assert LocalCheckpoint(host).read_state() is None
    assert LocalCheckpoint(host).read_pending() is not None
    assert checkpoint_bytes(host) == expected(run.states, 1)
