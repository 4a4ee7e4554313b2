"""Golden files freeze the on-disk format (see ``golden/make_golden.py`` for what they hold).

deltastore's reader must parse them, the reference reader must apply them, and regenerating
them with today's code must give the very same bytes: a change to what deltastore writes then
shows up here as a failing test and a diff of committed files, never silently.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import deltastore as ds
from deltastore.format.index import REFERENCE_KEYS, VersionIndex
from deltastore.format.names import INDEX_NAME
from tests.conftest import checkpoint_bytes, raw_bytes
from tests.format import reference_reader

GOLDEN = Path(__file__).resolve().parent / "golden"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_golden", module)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in (".safetensors", ".json")
    }


def _expected(version: int) -> dict[str, bytes]:
    return {name: raw_bytes(t) for name, t in gen.state(version).items()}


@pytest.fixture
def golden_store(tmp_path: Path) -> Path:
    """A copy of the golden store and base, so no test can modify the committed files."""
    shutil.copytree(GOLDEN / "store", tmp_path / "store")
    shutil.copytree(GOLDEN / "base", tmp_path / "base")
    return tmp_path


def test_regenerating_gives_identical_bytes(tmp_path: Path):
    committed = _files(GOLDEN)
    assert len(committed) == 10, sorted(committed)
    regenerated = _files(gen.generate(tmp_path / "out"))
    assert sorted(regenerated) == sorted(committed)
    changed = [name for name in committed if committed[name] != regenerated[name]]
    assert not changed, (
        f"deltastore now writes different bytes for {changed}; if the format change is "
        "deliberate, rerun tests/format/golden/make_golden.py and commit the diff"
    )


def test_index_has_reference_keys_and_six_digit_versions():
    for version in gen.VERSIONS:
        path = GOLDEN / "store" / f"weight_v{version:06d}" / INDEX_NAME
        body = json.loads(path.read_text())
        assert set(body) == {"metadata", "weight_map"}
        metadata = body["metadata"]
        encoding, checksum, full = gen.PLAN[version]
        assert metadata["version"] == f"{version:06d}"
        assert re.fullmatch(r"\d{6}", metadata["version"])
        assert metadata["checksum_format"] == checksum
        assert metadata["stream_id"] == gen.STREAM_ID
        assert metadata["commit_token"] == gen.commit_token(version)
        if full:
            assert "delta_encoding" not in metadata and "base_version" not in metadata
            assert set(body["weight_map"]) == set(gen.state(version))
        else:
            assert set(REFERENCE_KEYS) <= set(metadata)
            assert metadata["base_version"] == f"{version - 1:06d}"
            assert metadata["delta_encoding"] == encoding
            assert metadata["compression_format"] == "zstd"
            for shard in body["weight_map"].values():
                # Delta shards use the reference's 0-based pattern.
                assert re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", shard)
                assert shard.startswith("model-00000-of-")
    empty = json.loads((GOLDEN / "store" / "weight_v000005" / INDEX_NAME).read_text())
    assert empty["weight_map"] == {}


def test_our_reader_parses_the_golden_store():
    store = ds.VersionStore(GOLDEN / "store")
    assert store.versions() == list(gen.VERSIONS)
    assert store.latest() == 5
    for version in gen.VERSIONS:
        index = store.index(version)
        encoding, checksum, full = gen.PLAN[version]
        assert index.version == version
        assert index.kind == ("full" if full else "delta")
        assert index.encoding == (None if full else encoding)
        assert index.base_version == (None if full else version - 1)
        assert index.checksum == checksum
        assert index.stream_id == gen.STREAM_ID
        assert VersionIndex.from_json(index.to_json(), version=version) == index
        raw = (GOLDEN / "store" / f"weight_v{version:06d}" / INDEX_NAME).read_bytes()
        assert index.to_json() == raw, "the index no longer round-trips byte for byte"
        changed = {
            n
            for n in gen.state(version)
            if raw_bytes(gen.state(version)[n]) != raw_bytes(gen.state(version - 1)[n])
        }
        assert index.totals["tensor_count"] == len(index.weight_map)
        if full:
            assert set(index.weight_map) == set(gen.state(version))
        else:
            assert set(index.weight_map) == changed
        for shard, names in index.shards().items():
            header = store.read_shard_header(version, shard)
            assert sorted(header.tensors) == names
            for name in names:
                digest = header.metadata[name]
                want = reference_reader.digest(checksum, raw_bytes(gen.state(version)[name]))
                assert digest == want
                if not full:
                    entry = header.tensors[name]
                    assert entry.dtype == "U8" and len(entry.shape) == 1


@pytest.mark.parametrize("reader", ["deltastore", "reference"])
def test_golden_chain_applies_byte_exact(golden_store: Path, reader: str):
    store, base = golden_store / "store", golden_store / "base"
    host = golden_store / "host"
    for version in (1, 2, 3, 4, 5, 2, 0, 5):
        if reader == "deltastore":
            result = ds.pull_weights(host, store, version, base_dir=base)
            assert result.version == version
            assert ds.verify_local(host, store, base_dir=base) == version
        else:
            reference_reader.pull(str(host), str(store), version, str(base))
            assert reference_reader.read_state(str(host)) == version
        assert checkpoint_bytes(host) == _expected(version), f"after pulling v{version}"
    # A late host goes straight to the newest version (through the full v3).
    late = golden_store / "late"
    if reader == "deltastore":
        ds.pull_weights(late, store, 5, base_dir=base)
    else:
        reference_reader.pull(str(late), str(store), 5, str(base))
    assert checkpoint_bytes(late) == _expected(5)
