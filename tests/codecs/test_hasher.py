"""A checksum fed piece by piece gives the digest of the whole bytes (a reseed hashes each
tensor as its shard streams in, in whatever pieces the network delivers)."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import CHECKSUMS, ByteArray, Checksum


class _Sum(Checksum):
    """A checksum that keeps the default hasher (one a plugin could register)."""

    name = "sum"
    hex_length = 8

    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        return f"{sum(memoryview(data).cast('B')) & 0xFFFFFFFF:08x}"


DATA = os.urandom(70_000)


@pytest.mark.parametrize("checksum", [*CHECKSUMS.values(), _Sum()], ids=lambda c: c.name)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(DATA)), max_size=12))
def test_pieces_hash_as_the_whole(checksum: Checksum, cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(DATA)]
    hasher = checksum.hasher()
    for start, end in itertools.pairwise(bounds):
        hasher.update(memoryview(DATA)[start:end])
    assert hasher.hexdigest() == checksum.hexdigest(DATA)


@pytest.mark.parametrize("checksum", [*CHECKSUMS.values(), _Sum()], ids=lambda c: c.name)
def test_no_piece_is_the_empty_digest(checksum: Checksum) -> None:
    assert checksum.hasher().hexdigest() == checksum.hexdigest(b"")
