"""Generate the golden version store committed next to this script.

    .venv/bin/python tests/format/golden/make_golden.py [OUT_DIR]   # default: this directory

Writes ``OUT_DIR/base/model.safetensors`` (the engines' base, version 0) and
``OUT_DIR/store/weight_v00000{1..5}/`` published by deltastore's own ``DeltaPublisher``:

====  ==========  =========  ===============================================
 v    kind        checksum   change
====  ==========  =========  ===============================================
 1    xor         xxh3-128   a bf16 row, an fp32 element
 2    overwrite   blake3     an int8 element, a bool, an fp8 row
 3    full        adler32    an fp16 element (every tensor is stored)
 4    xor         adler32    the 0-d fp32 scalar, another bf16 row
 5    xor         adler32    nothing (an empty delta: index only)
====  ==========  =========  ===============================================

Everything is deterministic: tensors are built from ``arange`` (no random generator), the
stream id and commit tokens (random in real use) are replaced by fixed strings, and only the
``weight_v*`` directories are kept (not the writers' ``_claims``). Regenerating must give
byte-identical files; ``test_golden.py`` checks that, so any change to what deltastore writes
shows up as a diff of these files. Regenerate only for a deliberate format change.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltastore import DeltaPublisher, VersionIndex, VersionStore
from deltastore.format.names import INDEX_NAME, version_dir_name

HERE = Path(__file__).resolve().parent
STREAM_ID = "golden-stream-0001"
VERSIONS = (1, 2, 3, 4, 5)
PLAN = {
    # version: (encoding, checksum, full)
    1: ("xor", "xxh3-128", False),
    2: ("overwrite", "blake3", False),
    3: ("xor", "adler32", True),
    4: ("xor", "adler32", False),
    5: ("xor", "adler32", False),
}


def commit_token(version: int) -> str:
    return f"golden-commit-{version:06d}"


def state(version: int) -> dict[str, torch.Tensor]:
    """The model's tensors after ``version`` (0 = the base)."""
    t = {
        "model.embed_tokens.weight": (torch.arange(48.0).reshape(6, 8) / 8 - 3).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": (torch.arange(16.0).reshape(4, 4) / 4).half(),
        "model.layers.0.mlp.fp8_weight": (torch.arange(32.0).reshape(4, 8) / 16 - 1).to(
            torch.float8_e4m3fn
        ),
        "model.layers.0.mlp.scale": torch.tensor([0.5, 1.0, 1.5]),
        "model.layers.0.quant.int8": torch.arange(-5, 5, dtype=torch.int8),
        "model.layers.0.mask": torch.tensor([True, False, True, True, False, False, True]),
        "model.norm.eps": torch.tensor(1e-5),
        "model.empty_bias": torch.zeros(0, dtype=torch.bfloat16),
    }
    if version >= 1:
        t["model.embed_tokens.weight"][1] += 1
        t["model.layers.0.mlp.scale"][0] = 2.5
    if version >= 2:
        t["model.layers.0.quant.int8"][3] = -7
        t["model.layers.0.mask"][2] = False
        t["model.layers.0.mlp.fp8_weight"][0] = torch.full((8,), 0.25).to(torch.float8_e4m3fn)
    if version >= 3:
        t["model.layers.0.self_attn.q_proj.weight"][0, 0] = -2
    if version >= 4:
        t["model.norm.eps"].fill_(1e-6)
        t["model.embed_tokens.weight"][5] *= -1
    return t


def _save(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: x.contiguous() for n, x in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _pin_tokens(store: VersionStore, version: int) -> None:
    """Replace the random stream id and commit token of a committed index with fixed ones.

    The values are swapped in the raw text (they are unique hex tokens), so every other byte
    stays exactly what the publisher wrote.
    """
    path = Path(store.root) / version_dir_name(version) / INDEX_NAME
    raw = path.read_text(encoding="utf-8")
    index = VersionIndex.from_json(raw.encode(), version=version)
    assert index.stream_id and index.commit_token
    for old, new in ((index.stream_id, STREAM_ID), (index.commit_token, commit_token(version))):
        raw = raw.replace(f'"{old}"', f'"{new}"')
    path.write_text(raw, encoding="utf-8")


def generate(out_dir: str | os.PathLike[str]) -> Path:
    """Write the golden base and store into ``out_dir`` (replacing what is there)."""
    out = Path(out_dir)
    for sub in ("base", "store"):
        shutil.rmtree(out / sub, ignore_errors=True)
    base = _save(out / "base", state(0))
    with tempfile.TemporaryDirectory(prefix="deltastore-golden-") as tmp:
        store = VersionStore(os.path.join(tmp, "store"))
        for version in VERSIONS:
            encoding, checksum, full = PLAN[version]
            # One publisher per version: each continues the stream from the previous state,
            # as `deltastore publish --prev` does, so encodings can change along the chain.
            prev = (
                base if version == 1 else _save(Path(tmp) / f"v{version - 1}", state(version - 1))
            )
            # The golden store freezes the reference layout as first committed: without the
            # optional base_digests record (tests/trust covers that key).
            publisher = DeltaPublisher(
                store,
                prev,
                encoding=encoding,
                checksum=checksum,
                workers=1,
                record_base_digests=False,
            )
            publisher.seed(continue_latest=True)
            result = publisher.publish(state(version).items(), full=full)
            assert result.version == version, result
            _pin_tokens(store, version)
        (out / "store").mkdir(parents=True)
        for version in VERSIONS:
            name = version_dir_name(version)
            shutil.copytree(Path(store.root) / name, out / "store" / name)
    return out


if __name__ == "__main__":
    print(generate(sys.argv[1] if len(sys.argv) > 1 else HERE))
