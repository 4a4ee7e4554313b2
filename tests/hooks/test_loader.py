"""deltastore.hooks.load: built-ins and examples by import path, and every way loading fails."""

from __future__ import annotations

from pathlib import Path

import pytest

import deltastore.hooks as hooks
from deltastore.errors import HookError
from deltastore.hooks import load

BUILTINS = {
    "posix_commit": "post_write",
    "posix_refresh": "pre_read",
    "s3_commit": "post_write",
    "s3_refresh": "pre_read",
    "gcs_commit": "post_write",
    "gcs_refresh": "pre_read",
    "mirror_commit": "post_write",
    "mirror_refresh": "pre_read",
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtins_load_by_reference_flag_value(name: str) -> None:
    # What --custom-update-weight-post-write-path / --custom-pull-weights-pre-read-hook hold.
    assert load(f"deltastore.hooks.{name}", kind=BUILTINS[name]) is getattr(hooks, name)


def test_builtins_refuse_the_other_signature() -> None:
    with pytest.raises(HookError, match=r"hook\(args, version_dir, rollout_engines\)"):
        load("deltastore.hooks.s3_refresh", kind="post_write")
    with pytest.raises(HookError, match=r"hook\(delta_dir, target_version\)"):
        load("deltastore.hooks.posix_commit", kind="pre_read")


def test_examples_load_by_path() -> None:
    for path, kind in [
        ("hooks.audit_log.on_commit", "post_write"),
        ("hooks.audit_log.on_refresh", "pre_read"),
        ("hooks.nfs_then_s3.commit", "post_write"),
        ("hooks.nfs_then_s3.refresh", "pre_read"),
    ]:
        assert callable(load(path, kind=kind))


def test_colon_form() -> None:
    assert load("deltastore.hooks:s3_commit") is hooks.s3_commit


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "is empty"),
        ("s3_commit", "names no module"),
        ("no_such_package_zz.hook", "no module named 'no_such_package_zz'"),
        ("deltastore.hooks.no_such_hook", "has no attribute 'no_such_hook'"),
        ("deltastore.hooks.mirror.REMOTE_URL_ENV", "is a str, not a function"),
    ],
)
def test_load_errors_name_the_problem(path: str, message: str) -> None:
    with pytest.raises(HookError, match=message) as info:
        load(path)
    assert repr(path) in str(info.value)


def test_module_whose_dependency_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_dep_hook.py").write_text("import no_such_dependency_zz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HookError, match="dependency 'no_such_dependency_zz' is missing"):
        load("needs_dep_hook.commit")


def test_module_that_raises_at_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_hook.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HookError, match="RuntimeError: boom at import"):
        load("broken_hook.commit")


def test_wrong_arity_of_a_user_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_hooks.py").write_text(
        "def two(a, b):\n    pass\n\ndef flexible(*args):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HookError, match=r"signature \(a, b\)"):
        load("user_hooks.two", kind="post_write")
    assert callable(load("user_hooks.two", kind="pre_read"))
    assert callable(load("user_hooks.flexible", kind="post_write"))
    with pytest.raises(HookError, match="unknown hook kind"):
        load("user_hooks.two", kind="commit")


@pytest.mark.parametrize("kind", [None, "post_write"])
def test_a_mistyped_hook_gets_a_did_you_mean_and_the_hooks_first(kind: str | None) -> None:
    with pytest.raises(HookError) as caught:
        load("deltastore.hooks.s3_comit", kind)
    message = str(caught.value)
    assert "did you mean deltastore.hooks.s3_commit?" in message
    hooks_part = message.split("its hooks: ", 1)[1].split(";", 1)[0]
    assert "s3_commit" in hooks_part.split(", ") and "posix_commit" in hooks_part.split(", ")
    assert "load" not in hooks_part.split(", ") and "check_arity" not in hooks_part
    if kind == "post_write":
        assert "s3_refresh" not in hooks_part, "a pre-read hook is not offered as post-write"
    assert message.index("s3_commit") < message.index("POST_WRITE")
