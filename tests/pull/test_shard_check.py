"""Each tensor of a streamed shard is checked against its digest whatever pieces the bytes
arrive in: a header split across pieces, a tensor split across many, empty tensors, a flipped
byte anywhere in the data, a shard cut short, a restart (a retried download)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import get_checksum
from deltastore.errors import FormatError
from deltastore.format.safetensors_io import parse_header
from deltastore.format.shard_stream import StreamedShardCheck
from deltastore.pull.chain import full_shard_check
from deltastore.testing.store_helpers import shard_bytes

XXH3 = get_checksum("xxh3-128")
TENSORS = {
    "a": bytes(range(256)) * 40,
    "b": b"",
    "c": bytes(reversed(range(256))) * 7 + b"tail",
    "d": b"\x01",
}


def _shard(tensors: dict[str, bytes], digests: dict[str, str] | None = None) -> bytes:
    if digests is None:
        digests = {n: XXH3.hexdigest(d) for n, d in tensors.items()}
    return shard_bytes(tensors, digests)


def _feed(check: StreamedShardCheck, data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for start, end in itertools.pairwise(bounds):
        check.update(data[start:end])


def _check() -> StreamedShardCheck:
    return full_shard_check(XXH3, "weight_v000003", "s3://b/weight_v000003/shard")


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 1 << 20), max_size=20))
def test_an_intact_shard_matches_in_any_pieces(cuts: list[int]) -> None:
    check = _check()
    _feed(check, _shard(TENSORS), cuts)
    assert check.mismatched() == []


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 1 << 20), max_size=20),
    victim=st.sampled_from(["a", "c", "d"]),
    where=st.floats(0, 1, exclude_max=True),
)
def test_a_flipped_data_byte_names_its_tensor(cuts: list[int], victim: str, where: float) -> None:
    data = bytearray(_shard(TENSORS))
    entry = parse_header(bytes(data[8 : 8 + int.from_bytes(data[:8], "little")])).tensors[victim]
    data[entry.start + int(where * entry.nbytes)] ^= 0x40
    check = _check()
    _feed(check, bytes(data), cuts)
    assert check.mismatched() == [victim]


def test_a_shard_cut_short_fails_its_last_tensors() -> None:
    data = _shard(TENSORS)
    check = _check()
    check.update(data[:-3])  # d's one byte and c's last two
    assert check.mismatched() == ["c", "d"]
    header_only = _check()
    header_only.update(data[:5])
    assert header_only.mismatched() == ["(the shard header)"]


def test_a_restart_forgets_what_was_fed() -> None:
    data = _shard(TENSORS)
    check = _check()
    check.update(data[: len(data) // 2])
    check.update(b"garbage")
    check.restart()
    _feed(check, data, [17, 4000])
    assert check.mismatched() == []


def test_tensors_without_a_digest_are_not_checked_and_bad_digests_refused() -> None:
    check = _check()
    check.update(_shard(TENSORS, {"a": XXH3.hexdigest(TENSORS["a"])}))
    assert check.mismatched() == []
    with pytest.raises(FormatError, match=r"weight_v000003: tensor 'a'"):
        _check().update(_shard(TENSORS, {"a": "not-hex"}))
