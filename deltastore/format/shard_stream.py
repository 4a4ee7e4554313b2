"""Checking a shard while its bytes stream past: the header, then each tensor's digest.

A reseed (pull) and a replica's copy both see a shard once, front to back; hashing each
tensor's byte range as it passes checks it in that pass, without holding the shard or reading
the copy back. Which digest a tensor must have (``expected``) and the hash (``new_hasher``, e.g.
a ``deltastore.codecs`` checksum's ``hasher``) are the caller's: the format layer never sees a
codec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from deltastore.errors import FormatError
from deltastore.format.packed import unpack_header
from deltastore.format.safetensors_io import SafetensorsHeader, header_length, parse_header

HEADER_NOT_READ = "(the shard header)"  # what mismatched() names for a header never whole


class StreamHasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


ExpectedDigests = Callable[[SafetensorsHeader], Mapping[str, str]]
"""``expected(header)``: the digest (lowercase hex) each checked tensor must hash to, by name;
tensors left out are not hashed. It may raise (a missing or malformed digest)."""
Mismatch = Callable[[str, str, str], None]
"""``on_mismatch(tensor, recorded, read)``: called when a whole tensor hashed to another digest."""


@dataclass
class _Span:
    name: str
    start: int
    end: int
    expected: str
    hasher: StreamHasher
    fed: int = 0


class StreamedShardCheck:
    """Follows one shard's bytes in file order and checks each tensor as its bytes pass.

    Feed consecutive pieces with :meth:`update` (a download sink). The header is parsed once
    whole (packed or plain); ``size``, when known, bounds it. A whole tensor that hashes to
    another digest than ``expected`` gives it goes to ``on_mismatch`` (which may raise) and to
    :meth:`mismatched`. :class:`FormatError` for a malformed header, and from :meth:`finish`
    for a shard cut short.
    """

    def __init__(
        self,
        source: str,
        new_hasher: Callable[[], StreamHasher],
        expected: ExpectedDigests,
        *,
        size: int | None = None,
        on_mismatch: Mismatch | None = None,
    ) -> None:
        self.source = source
        self.size = size
        self._new_hasher = new_hasher
        self._expected = expected
        self._on_mismatch = on_mismatch
        self.restart()

    def restart(self) -> None:
        """Forget what was fed: the shard comes again from its first byte."""
        self.offset = 0  # bytes fed so far
        self.header: SafetensorsHeader | None = None
        self.checked = 0  # tensors hashed whole to their digest
        self._head = bytearray()
        self._spans: list[_Span] = []
        self._next = 0
        self._bad: set[str] = set()

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.header is None:
            view = self._take_header(view)
            if self.header is None:
                return
        self._feed(view)

    def mismatched(self) -> list[str]:
        """Tensors (in file order) whose bytes did not hash to their digest or did not all
        arrive."""
        if self.header is None:
            return [HEADER_NOT_READ]
        unfinished = {
            s.name
            for s in self._spans[self._next :]
            if s.fed != s.end - s.start or s.hasher.hexdigest() != s.expected
        }
        return [s.name for s in self._spans if s.name in self._bad or s.name in unfinished]

    def finish(self) -> SafetensorsHeader:
        """The header, once the whole shard passed (``size`` bytes, every checked tensor)."""
        if self.header is None or (self.size is not None and self.offset != self.size):
            raise FormatError(
                f"{self.source}: read {self.offset} bytes of {self.size}, header "
                f"{'parsed' if self.header else 'incomplete'}; the file is truncated"
            )
        if self._next < len(self._spans):
            raise FormatError(
                f"{self.source}: tensor {self._spans[self._next].name!r} is cut short"
            )
        return self.header

    def _take_header(self, view: memoryview) -> memoryview:
        """Keep the header's bytes until it is whole, then parse it; returns the bytes after."""
        before = len(self._head)
        self._head += view
        self.offset += len(view)
        if len(self._head) < 8:
            return view[len(view) :]
        total = 8 + header_length(bytes(self._head[:8]), source=self.source)
        if len(self._head) < total:
            return view[len(view) :]
        parsed = parse_header(bytes(self._head[8:total]), file_size=self.size, source=self.source)
        header = unpack_header(parsed, source=self.source)
        entries = header.tensors
        spans = [
            _Span(name, entries[name].start, entries[name].end, digest, self._new_hasher())
            for name, digest in self._expected(header).items()
        ]
        self._spans = sorted(spans, key=lambda s: (s.start, s.end))
        self.header = header
        self._head = bytearray()
        self.offset = total
        return view[total - before :]

    def _feed(self, view: memoryview) -> None:
        begin = self.offset
        end = begin + len(view)
        spans = self._spans
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
            self._check(spans[self._next])
            self._next += 1
        self.offset = end

    def _check(self, span: _Span) -> None:
        got = span.hasher.hexdigest()
        if got == span.expected:
            self.checked += 1
            return
        self._bad.add(span.name)
        if self._on_mismatch is not None:
            self._on_mismatch(span.name, span.expected, got)
