"""What the store's own messages say: the URL as the user wrote it, the install command."""

from __future__ import annotations

import pytest

from deltastore.errors import ConfigError
from deltastore.storage import VersionStore


def test_an_http_url_is_shown_once() -> None:
    store = VersionStore("http://example.invalid/x")
    assert store.url == "http://example.invalid/x"  # was http://http://example.invalid/x


def test_a_missing_extra_is_named_as_a_pip_command() -> None:
    error = VersionStore._open_failed("s3://b/run1", "s3", ImportError("no s3fs"))
    assert isinstance(error, ConfigError)
    assert "pip install 'deltastore[s3]'" in str(error)


@pytest.mark.parametrize("url", ["s3://b/run1", "/tmp/somewhere"])
def test_other_urls_are_unchanged(url: str) -> None:
    assert VersionStore(url).url == url


def test_prune_says_one_delta_in_the_singular() -> None:
    from deltastore.storage.prune import PruneReport

    report = PruneReport(
        keep=(3, 4, 5),
        unpublish=(),
        fence=(),
        delete=(),
        waiting=(),
        stray=(),
        dry_run=True,
        grace_s=0.0,
        chain_kept=(3, 4),
    )
    assert "v000005 is a delta whose chain needs v000003, v000004" in "\n".join(report.lines())


def test_a_failed_listing_names_its_url_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from deltastore.errors import StoreError
    from deltastore.storage import RetryPolicy

    store = VersionStore(str(tmp_path), retry=RetryPolicy(attempts=1))

    def refused(*args: object, **kwargs: object) -> None:
        raise ValueError("no credentials found")  # what a backend without credentials raises

    monkeypatch.setattr(store.fs, "find", refused)
    with pytest.raises(StoreError) as caught:
        store.listing()
    message = str(caught.value)
    assert message.count(str(tmp_path)) == 1 and "listing on" in message, message
