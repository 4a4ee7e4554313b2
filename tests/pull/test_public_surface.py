"""One error tree and one public surface: every exception lives in deltastore.errors, and the
top-level package exports what users catch or configure."""

from __future__ import annotations

import inspect
import pkgutil

import pytest

import deltastore
import deltastore.errors as errors


def test_every_exception_class_of_the_package_is_defined_in_errors():
    import importlib

    strays = []
    for module in pkgutil.walk_packages(deltastore.__path__, "deltastore."):
        if module.name.startswith(("deltastore.testing", "deltastore.cli")) or module.name.endswith(
            "__main__"
        ):
            continue
        mod = importlib.import_module(module.name)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.name
                and module.name != "deltastore.errors"
                and not name.startswith("_")  # private signals caught where raised
            ):
                strays.append(f"{module.name}.{name}")
    assert strays == []


def test_the_top_level_exports_every_error_and_what_users_configure():
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, errors.DeltastoreError):
            assert getattr(deltastore, name) is obj, name
            assert name in deltastore.__all__
    for name in ("RetryPolicy", "PullResult", "GroupPullError", "LockTimeoutError"):
        assert name in deltastore.__all__


def test_a_group_outside_torch_distributed_is_a_config_error():
    with pytest.raises(deltastore.ConfigError, match="not initialised"):
        deltastore.pull_weights("/nonexistent/h", "/nonexistent/s", 1, process_group="world")
