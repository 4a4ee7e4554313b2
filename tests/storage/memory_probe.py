"""Child process of test_memory_bound: stream a large file through a store, report peaks.

Usage: python memory_probe.py URL OPTIONS_JSON SIZE BLOCK_SIZE. Prints one JSON line with the
tracemalloc peaks (bytes) of the upload and of the two kinds of read, and whether the bytes
read back equal the bytes written. Run in its own process so that nothing else (a server in
the test process) shares the allocation counts.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tracemalloc

from deltastore.storage import VersionStore, new_token

CHUNK = 1024 * 1024


def chunk(i: int) -> bytes:
    """Deterministic, distinct 1 MiB chunks (no need to keep what was written)."""
    return hashlib.sha256(i.to_bytes(8, "little")).digest() * (CHUNK // 32)


def main() -> None:
    url, options, size, block = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    store = VersionStore(url, options, block_size=block)
    writer = store.begin(1, token=new_token())
    name = "model-00000-of-00001.safetensors"
    expected = hashlib.sha256()
    tracemalloc.start()
    tracemalloc.reset_peak()
    with writer.open_write(name) as fh:
        for i in range(size // CHUNK):
            data = chunk(i)
            expected.update(data)
            fh.write(data)
            del data
    write_peak = tracemalloc.get_traced_memory()[1]

    tracemalloc.reset_peak()
    ranged = hashlib.sha256()
    step = 4 * CHUNK
    for start in range(0, size, step):
        ranged.update(store.read_range(1, name, start, min(size, start + step)))
    range_peak = tracemalloc.get_traced_memory()[1]

    tracemalloc.reset_peak()
    streamed = hashlib.sha256()
    with store.open_read(1, name) as fh:
        while data := fh.read(CHUNK):
            streamed.update(data)
    stream_peak = tracemalloc.get_traced_memory()[1]
    print(
        json.dumps(
            {
                "size": store.file_size(1, name),
                "write_peak": write_peak,
                "range_peak": range_peak,
                "stream_peak": stream_peak,
                "ranged_ok": ranged.digest() == expected.digest(),
                "streamed_ok": streamed.digest() == expected.digest(),
            }
        )
    )


if __name__ == "__main__":
    main()
