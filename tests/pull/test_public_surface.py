"""One error tree and one public surface: every exception lives in deltastore.errors, and the
top-level package exports the verbs, what they return, what users configure and the error
categories worth catching."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

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


def test_the_top_level_exports_the_verbs_results_configuration_and_error_categories():
    verbs = ["DeltaPublisher", "VersionStore", "pull_weights", "replicate", "verify_local"]
    results = ["HostOutcome", "PublishResult", "PullResult", "RepairSummary", "ReplicationReport"]
    results += ["VersionIndex"]
    configuration = ["ProgressCallback", "PublisherConfig", "RetryPolicy"]
    extension = ["register_encoding", "__version__"]
    categories = ["DeltastoreError", "ApplyError", "ConfigError", "FormatError", "IntegrityError"]
    categories += ["PublishError", "StoreError", "VersionNotFoundError"]
    expected = [*verbs, *results, *configuration, *extension, *categories]
    assert sorted(deltastore.__all__) == sorted(expected)
    for name in deltastore.__all__:
        obj = getattr(deltastore, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert getattr(errors, name) is obj, name


def test_every_other_error_resolves_from_the_top_level_with_a_warning_naming_its_home():
    others = [
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, (errors.DeltastoreError, Warning))
        and name not in deltastore.__all__
    ]
    assert "TransientStoreError" in others and "GroupPullError" in others
    for name in others:
        with pytest.warns(DeprecationWarning, match=f"from deltastore.errors import {name}"):
            assert getattr(deltastore, name) is getattr(errors, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        deltastore.no_such_name  # noqa: B018


def test_a_group_outside_torch_distributed_is_a_config_error():
    with pytest.raises(deltastore.ConfigError, match="not initialised"):
        deltastore.pull_weights("/nonexistent/h", "/nonexistent/s", 1, process_group="world")


def test_the_lazy_top_level_gives_each_name_from_its_home_whatever_was_imported_first():
    """The top level imports its surface on first use; a subpackage loaded before (here
    ``deltastore.replicate``, whose name is also the verb's) must not take a verb's place."""
    code = (
        "import inspect, sys\n"
        "from deltastore.replicate.replicator import ReplicationPolicy\n"
        "import deltastore as ds\n"
        "assert 'torch' not in sys.modules\n"
        "assert inspect.isfunction(ds.replicate), ds.replicate\n"
        "from deltastore import replicate\n"
        "assert inspect.isfunction(replicate)\n"
        "assert set(ds.__all__) <= set(dir(ds))\n"
        "print(sorted(n for n in ds.__all__ if getattr(ds, n) is None))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    for name, module in deltastore._LAZY.items():
        assert getattr(deltastore, name) is getattr(importlib.import_module(module), name)
