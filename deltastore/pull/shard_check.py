"""Checking a full version's tensors against their digests while the shard downloads.

A reseed must verify every tensor before it swaps the staged files in. Hashing each tensor's
byte range as the shard's bytes arrive does that in the same pass as the download, instead of
reading the whole staged copy back afterwards (176 MB: one more pass over the data, with the
interpreter's lock taken per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltastore.codecs import Checksum, Hasher
from deltastore.format.safetensors_io import header_length, parse_header
from deltastore.pull.history import recorded_digests


@dataclass
class _Span:
    name: str
    start: int
    end: int
    hasher: Hasher
    expected: str
    fed: int = 0


@dataclass
class ShardDigests:
    """A download sink (see :meth:`VersionStore.download`) for one safetensors shard of a full
    version: it reads the shard's header from the first bytes, then hashes every tensor the
    header's metadata gives a digest for (:func:`~deltastore.pull.history.recorded_digests`:
    tensors without one are not checked).

    ``where`` names the version in errors. A malformed header or digest raises
    :class:`FormatError` from :meth:`update`; :meth:`mismatched` lists the tensors that did not
    match once the download is over.
    """

    checksum: Checksum
    where: str
    source: str
    """The shard's URL, for errors."""
    _head: bytearray = field(default_factory=bytearray)
    _spans: list[_Span] | None = None
    _position: int = 0
    _next: int = 0

    def restart(self) -> None:
        self._head = bytearray()
        self._spans = None
        self._position = 0
        self._next = 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        if self._spans is None:
            view = self._take_header(view)
            if self._spans is None:
                return
        self._feed(view)

    def mismatched(self) -> list[str]:
        """Tensors whose bytes did not hash to their digest, or did not all arrive."""
        if self._spans is None:
            return ["(the shard header)"]
        return [
            s.name
            for s in self._spans
            if s.fed != s.end - s.start or s.hasher.hexdigest() != s.expected
        ]

    def _take_header(self, view: memoryview) -> memoryview:
        """Keep the header's bytes until it is whole, then parse it; the data bytes left."""
        self._head += view
        if len(self._head) < 8:
            return view[len(view) :]
        total = 8 + header_length(bytes(self._head[:8]), source=self.source)
        if len(self._head) < total:
            return view[len(view) :]
        header = parse_header(bytes(self._head[8:total]), source=self.source)
        spans = []
        for name, digest in recorded_digests(header, self.checksum, where=self.where).items():
            entry = header.tensors[name]
            spans.append(_Span(name, entry.start, entry.end, self.checksum.hasher(), digest.hex))
        self._spans = sorted(spans, key=lambda s: (s.start, s.end))
        rest = memoryview(bytes(self._head[total:]))
        self._head = bytearray()
        self._position = total
        return rest

    def _feed(self, view: memoryview) -> None:
        spans = self._spans
        assert spans is not None
        begin = self._position
        end = begin + len(view)
        # Spans are sorted by start: every span before _next has all its bytes already.
        for i in range(self._next, len(spans)):
            span = spans[i]
            if span.start >= end:
                break
            low, high = max(span.start, begin), min(span.end, end)
            if high > low:
                span.hasher.update(view[low - begin : high - begin])
                span.fed += high - low
        while self._next < len(spans) and spans[self._next].end <= end:
            self._next += 1
        self._position = end
