"""Committed sparse-v2 and auto payloads: every encoder (numpy and numba, one tensor and a
batch) must write these very bytes.

``golden/payloads.npz`` was written by ``python -m tests.codecs.test_golden_payloads`` before the
encoders were merged; a change to what any encoder writes fails here. Regenerate only for a
deliberate format change (a new encoding name).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from deltastore.codecs import decompress, get_encoding
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding

GOLDEN = Path(__file__).resolve().parent / "golden" / "payloads.npz"
needs_numba = pytest.mark.skipif(
    __import__("importlib").util.find_spec("numba") is None, reason="numba not installed"
)


def cases() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """(old, new, itemsize) by name: element sizes, tails, a chunked tensor, steps of every
    width (patches), random and dense changes, nothing changed."""
    rng = np.random.default_rng(20261201)
    out: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
    for itemsize in (1, 2, 4, 8):
        for nbytes in (8, 4096, 65536, 3 << 20):
            old = rng.integers(0, 256, nbytes, dtype=np.uint8)
            elements = old.view(f"<u{itemsize}")
            new = old.copy()
            moved = new.view(f"<u{itemsize}")
            picked = np.flatnonzero(rng.random(elements.size) < 0.004)
            moved[picked] += rng.choice([1, -1], picked.size).astype(moved.dtype)
            wide = picked[::7]
            moved[wide] += rng.integers(1, 1 << (4 * itemsize), wide.size).astype(moved.dtype)
            out[f"ulp-{itemsize}-{nbytes}"] = (old, new, itemsize)
        old = rng.integers(0, 256, 8192, dtype=np.uint8)
        dense = old.copy()
        dense[rng.random(8192) < 0.3] ^= rng.integers(1, 256, dtype=np.uint8)
        out[f"dense-{itemsize}"] = (old, dense, itemsize)
        out[f"random-{itemsize}"] = (old, rng.integers(0, 256, 8192, dtype=np.uint8), itemsize)
        out[f"unchanged-{itemsize}"] = (old, old.copy(), itemsize)
    old = rng.integers(0, 256, 4099, dtype=np.uint8)  # a tail: coded byte by byte
    new = old.copy()
    new[[0, 17, 4098]] ^= 0x40
    out["tail-2-4099"] = (old, new, 2)
    out["odd-3-4098"] = (old[:4098], new[:4098], 3)
    return out


def _encodings(use_jit: bool) -> dict[str, CompactSparseEncoding | AutoEncoding]:
    return {
        "sparse-v2": CompactSparseEncoding(use_jit=use_jit),
        "auto": AutoEncoding(use_jit=use_jit),
    }


def _payloads(use_jit: bool, batch: bool) -> dict[str, bytes]:
    found = {}
    named = cases()
    for label, encoding in _encodings(use_jit).items():
        if batch:
            olds, news, sizes = zip(*named.values(), strict=True)
            framed = encoding.encode_framed(list(olds), list(news), list(sizes))
            bound = encoding.max_payload_size
            for name, (old, _, _), delta in zip(named, named.values(), framed, strict=True):
                found[f"{label}/{name}"] = (
                    decompress(delta.frame, max_size=bound(old.size), what=name)
                    if delta.changed_bytes
                    else b""
                )
        else:
            for name, (old, new, itemsize) in named.items():
                delta = encoding.encode(old, new, itemsize=itemsize)
                found[f"{label}/{name}"] = bytes(delta.payload) if delta.changed_bytes else b""
    return found


@pytest.mark.parametrize(
    "use_jit", [False, pytest.param(True, marks=needs_numba)], ids=["numpy", "numba"]
)
@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_every_encoder_writes_the_committed_bytes(use_jit: bool, batch: bool):
    with np.load(GOLDEN) as golden:
        expected = {name: golden[name].tobytes() for name in golden.files}
    got = _payloads(use_jit, batch)
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if got[name] != expected[name]] == []
    assert sum(len(p) for p in expected.values()) > 10_000  # not an empty golden file


def test_golden_payloads_apply_to_the_new_bytes():
    with np.load(GOLDEN) as golden:
        for name, (old, new, _) in cases().items():
            payload = golden[f"auto/{name}"].tobytes()
            if payload:
                target = old.copy()
                get_encoding("auto").apply(target, payload, tensor=name)
                assert target.tobytes() == new.tobytes(), name


if __name__ == "__main__":
    payloads = _payloads(use_jit=False, batch=False)
    assert payloads == _payloads(use_jit=True, batch=True)
    arrays = {name: np.frombuffer(p, dtype=np.uint8) for name, p in payloads.items()}
    np.savez_compressed(GOLDEN, **arrays)  # type: ignore[arg-type]
    print(f"wrote {len(arrays)} payloads to {GOLDEN}", file=sys.stderr)
