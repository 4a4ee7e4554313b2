"""Loading a hook by import path: ``load("package.module.function")``."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from deltastore.errors import HookError

POST_WRITE = "post_write"
PRE_READ = "pre_read"
_PARAMETERS = {
    POST_WRITE: ["args", "version_dir", "rollout_engines"],
    PRE_READ: ["delta_dir", "target_version"],
}
"""The reference hooks' parameter names: how a module's hooks are told from its helpers."""


def load(path: str, kind: str | None = None) -> Callable[..., Any]:
    """Import the callable named by ``path`` (``pkg.module.func`` or ``pkg.module:func``);
    with ``kind`` (``"post_write"`` or ``"pre_read"``) it must accept the reference hook's
    arguments. :class:`HookError` names the path and the problem."""
    if kind is not None and kind not in _PARAMETERS:
        raise HookError(f"unknown hook kind {kind!r}; expected one of {sorted(_PARAMETERS)}")
    if not isinstance(path, str) or not path.strip():
        raise HookError(f"hook path {path!r} is empty; expected 'package.module.function'")
    path = path.strip()
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise HookError(
            f"hook path {path!r} names no module; expected 'package.module.function' "
            "(e.g. deltastore.hooks.s3_commit)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise HookError(
                f"cannot load hook {path!r}: no module named {missing!r}; check the spelling "
                "and that its package is installed or on PYTHONPATH"
            ) from exc
        raise HookError(
            f"cannot load hook {path!r}: importing {module_name!r} failed because its "
            f"dependency {missing!r} is missing"
        ) from exc
    except Exception as exc:
        raise HookError(
            f"cannot load hook {path!r}: importing {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        hook = getattr(module, attr)
    except AttributeError:
        raise HookError(_no_such_hook(path, module, module_name, attr, kind)) from None
    if not callable(hook):
        raise HookError(
            f"hook {path!r} is a {type(hook).__name__}, not a function; point at a callable"
        )
    if kind is not None:
        check_arity(hook, kind, path)
    return hook  # type: ignore[no-any-return]


def _hook_names(module: Any, kind: str | None) -> tuple[list[str], list[str]]:
    """(the module's public functions whose parameters are the reference hook's, of ``kind``
    or of any kind; its other public names), each sorted. Submodules are left out."""
    shapes = [_PARAMETERS[kind]] if kind is not None else list(_PARAMETERS.values())
    hooks: list[str] = []
    other: list[str] = []
    for name in sorted(n for n in dir(module) if not n.startswith("_")):
        value = getattr(module, name, None)
        if inspect.ismodule(value):
            continue
        (hooks if _parameters(value) in shapes else other).append(name)
    return hooks, other


def _parameters(value: Any) -> list[str] | None:
    if not inspect.isfunction(value):
        return None
    return [
        p.name
        for p in inspect.signature(value).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _no_such_hook(path: str, module: Any, module_name: str, attr: str, kind: str | None) -> str:
    """The message for a module without ``attr``: a "did you mean", then its hooks first."""
    hooks, other = _hook_names(module, kind)
    close = difflib.get_close_matches(attr, hooks + other, n=1, cutoff=0.6)
    hint = f"; did you mean {module_name}.{close[0]}?" if close else ""
    listed = f"its hooks: {', '.join(hooks)}" if hooks else "it defines no hook"
    if other:
        listed += f"; other names: {', '.join(other[:8])}" + (", ..." if len(other) > 8 else "")
    return (
        f"cannot load hook {path!r}: module {module_name!r} has no attribute {attr!r}{hint} "
        f"({listed})"
    )


def check_arity(hook: Callable[..., Any], kind: str, name: str = "hook") -> None:
    """Raise :class:`HookError` if ``hook`` cannot be called like a ``kind`` hook."""
    parameters = _PARAMETERS[kind]
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    try:
        signature.bind(*([None] * len(parameters)))
    except TypeError as exc:
        raise HookError(
            f"hook {name!r} has signature {signature}, but a {kind.replace('_', '-')} hook is "
            f"called as hook({', '.join(parameters)}) ({exc})"
        ) from None
