"""What a replica checks of a shard as its bytes are copied: the rules, over the one
streamed check (:class:`~deltastore.format.shard_stream.StreamedShardCheck`) and the
reference checksums' incremental hashers (:mod:`deltastore.codecs`)."""

from __future__ import annotations

from deltastore.codecs import CHECKSUMS, Hasher, get_checksum
from deltastore.errors import FormatError, IntegrityError
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.format.shard_stream import StreamedShardCheck

_HEX = frozenset("0123456789abcdef")


def new_file_hasher() -> Hasher:
    """The whole-file digest that compares a copy with what was read from its source."""
    return get_checksum("xxh3-128").hasher()


def shard_checker(
    source: str, size: int, checksum: str | None, *, check_digests: bool, hash_tensors: bool
) -> StreamedShardCheck:
    """A check of one shard of ``size`` bytes fed in file order (``source`` names it).

    When ``checksum`` names a registered checksum and ``check_digests`` is set, every tensor
    must carry a well-formed digest in the header's metadata; with ``hash_tensors`` (a full
    version: a tensor's bytes are its value; a delta's digests describe the tensor after
    applying, which only an engine holds) each tensor's bytes are hashed and compared.
    Raises :class:`FormatError` for a malformed header or a missing digest, and
    :class:`IntegrityError` as soon as a tensor does not match its digest.
    """
    algorithm = get_checksum(checksum) if checksum in CHECKSUMS else None

    def expected(header: SafetensorsHeader) -> dict[str, str]:
        if not check_digests or algorithm is None:
            return {}
        for name in header.tensors:
            digest = header.metadata.get(name, "")
            if len(digest) != algorithm.hex_length or not set(digest) <= _HEX:
                raise FormatError(
                    f"{source}: tensor {name!r} has no valid {algorithm.name} digest in its "
                    "shard metadata; the source's copy is corrupt or foreign"
                )
        return {name: header.metadata[name] for name in header.tensors} if hash_tensors else {}

    def mismatch(name: str, recorded: str, read: str) -> None:
        assert algorithm is not None
        raise IntegrityError(
            f"{source}: tensor {name!r} does not match its {algorithm.name} digest (recorded "
            f"{recorded}, read {read}); the source's copy is corrupt, republish that version "
            "before replicating it"
        )

    new_hasher = algorithm.hasher if algorithm is not None else new_file_hasher
    return StreamedShardCheck(source, new_hasher, expected, size=size, on_mismatch=mismatch)
