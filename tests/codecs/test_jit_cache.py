"""Compiled kernels cached on disk are dropped when any kernel module changes, not only their
own (numba keys a kernel's cache on its own file, though it compiles its callees into it)."""

from __future__ import annotations

from pathlib import Path

from deltastore.codecs.jit import drop_stale_kernels


def test_a_change_in_any_kernel_module_drops_every_cached_kernel(tmp_path: Path):
    (tmp_path / "jit_calls.py").write_text("def caller(): ...\n")
    (tmp_path / "jit_called.py").write_text("def callee(): return 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    cached = [cache / "jit_calls.caller-1.py311.nbi", cache / "jit_calls.caller-1.py311.1.nbc"]
    other = cache / "other.cpython-311.pyc"
    for path in [*cached, other]:
        path.write_bytes(b"x")

    assert drop_stale_kernels(str(tmp_path))  # no stamp yet: nothing is known to be current
    assert not any(path.exists() for path in cached) and other.exists()

    for path in cached:  # compiled again from these sources
        path.write_bytes(b"x")
    assert not drop_stale_kernels(str(tmp_path))
    assert all(path.exists() for path in cached)

    (tmp_path / "jit_called.py").write_text("def callee(): return 2\n")  # the callee changed
    assert drop_stale_kernels(str(tmp_path))
    assert not any(path.exists() for path in cached) and other.exists()


def test_a_cache_that_cannot_be_written_is_left_alone(tmp_path: Path):
    (tmp_path / "jit_calls.py").write_text("def caller(): ...\n")
    (tmp_path / "__pycache__").write_text("not a directory")
    assert not drop_stale_kernels(str(tmp_path))
