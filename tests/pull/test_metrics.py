"""What a pull reports (byte counts, phase split) and ``GET /metrics`` of ``deltastore serve``,
parsed with ``prometheus_client``'s own parser: its counters move with pulls and failures."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import deltastore as ds
from deltastore.format.safetensors_io import read_header_file
from deltastore.pull.server import ServerConfig
from tests.pull.helpers import changed_between, many_tensors, publish_versions, write_checkpoint
from tests.pull.serving import running_server


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _pull(url: str, local: Path, store: Path, version: int) -> tuple[int, dict[str, object]]:
    body = {"local_checkpoint_dir": str(local), "source_dir": str(store), "target_version": version}
    request = urllib.request.Request(
        f"{url}/pull_weights",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _corrupt_a_payload(store_dir: Path, version: int) -> None:
    shard = next((store_dir / f"weight_v{version:06d}").glob("*.safetensors"))
    entry = max(read_header_file(str(shard)).tensors.values(), key=lambda e: e.end - e.start)
    data = bytearray(shard.read_bytes())
    data[(entry.start + entry.end) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_pull_reports_its_bytes_tensors_and_phases(tmp_path: Path):
    base = many_tensors(24, seed=5, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 3, seed=6)
    host = tmp_path / "host"

    first = ds.pull_weights(host, published.store_dir, 1, base_dir=tmp_path / "base")
    assert first.action == "reseeded" and first.reseeds == 1 and first.tensors_skipped == 0
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert first.bytes_reconstructed >= base_bytes  # the base copied in, then v1's patches
    assert {"prepare", "reseed", "apply"} <= set(first.phase_seconds)

    second = ds.pull_weights(host, published.store_dir, 3, base_dir=tmp_path / "base")
    changed = changed_between(published, 1, 3)
    assert second.action == "applied" and second.reseeds == 0
    assert second.tensors_applied == len(changed)
    assert second.tensors_skipped == len(base) - len(changed)
    assert second.wire_bytes == second.bytes_read > 0
    changed_size = sum(base[n].numel() * base[n].element_size() for n in changed)
    assert second.bytes_reconstructed == changed_size  # each changed tensor written once
    assert set(second.phase_seconds) == {"prepare", "apply"}
    assert sum(second.phase_seconds.values()) <= second.seconds

    again = ds.pull_weights(host, published.store_dir, 3, base_dir=tmp_path / "base")
    assert again.action == "noop" and again.tensors_skipped == len(base)
    assert again.bytes_read == again.bytes_reconstructed == 0
    assert set(again.phase_seconds) == {"prepare"}


def test_metrics_move_with_pulls_and_failures(tmp_path: Path):
    base = many_tensors(24, seed=7, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 3, seed=8)
    host = tmp_path / "host"
    config = ServerConfig(base_dir=str(tmp_path / "base"), allow=(str(tmp_path),))
    with running_server(config) as running:
        before = _samples(running.url)
        for outcome in ("noop", "applied", "reseeded", "repaired", "failed"):
            assert before[("deltastore_pulls_total", (("outcome", outcome),))] == 0
        assert before[("deltastore_pull_wire_bytes_total", ())] == 0

        assert _pull(running.url, host, published.store_dir, 1)[0] == 200  # reseed + v1
        assert _pull(running.url, host, published.store_dir, 2)[0] == 200  # applied
        assert _pull(running.url, host, published.store_dir, 2)[0] == 200  # noop
        after = _samples(running.url)
        outcome = {
            o: after[("deltastore_pulls_total", (("outcome", o),))]
            for o in ("noop", "applied", "reseeded", "failed")
        }
        assert outcome == {"noop": 1, "applied": 1, "reseeded": 1, "failed": 0}
        assert after[("deltastore_pull_reseeds_total", ())] == 1
        assert after[("deltastore_pull_wire_bytes_total", ())] > 0
        assert after[("deltastore_pull_reconstructed_bytes_total", ())] > 0
        applied = after[("deltastore_pull_tensors_applied_total", ())]
        assert applied >= len(changed_between(published, 1, 2))
        gauge = ("deltastore_checkpoint_version", (("local_checkpoint_dir", str(host)),))
        assert after[gauge] == 2
        total = ("deltastore_pull_phase_seconds_count", (("phase", "total"),))
        assert after[total] == 3
        assert after[("deltastore_pull_phase_seconds_count", (("phase", "apply"),))] == 2

        _corrupt_a_payload(published.store_dir, 3)
        status, reply = _pull(running.url, host, published.store_dir, 3)
        assert status == 400 and reply["success"] is False
        failed = _samples(running.url)
        assert failed[("deltastore_pulls_total", (("outcome", "failed"),))] == 1
        assert failed[gauge] == 2  # the host stayed at its verified version
        assert failed[total] == 3  # a failed pull is not a phase sample
        wire = ("deltastore_pull_wire_bytes_total", ())
        assert failed[wire] == after[wire]  # counted on success only
        # The same object the server counts with, read in the process.
        assert running.server.metrics.pulls.labels("failed")._value.get() == 1


def test_metrics_need_the_token_when_the_server_has_one(tmp_path: Path):
    write_checkpoint(tmp_path / "base", many_tensors(4, seed=9, elements=64))
    config = ServerConfig(base_dir=str(tmp_path / "base"), token="tok")
    with running_server(config) as running:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{running.url}/metrics", timeout=30)
        assert info.value.code == 401
        request = urllib.request.Request(
            f"{running.url}/metrics", headers={"Authorization": "Bearer tok"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert b"deltastore_pulls_total" in response.read()
