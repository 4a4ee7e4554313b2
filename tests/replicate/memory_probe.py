"""Child process of test_memory: replicate a local store into S3 under tracemalloc.

Usage: python memory_probe.py SRC_DIR DST_URL JOBS CHUNK BLOCK. The destination's endpoint
and credentials come from the environment; CHUNK is the bytes per ranged read, BLOCK the
destination's upload part size. Prints one JSON line: the peak of Python allocations
(bytes) during the copy, and the versions copied.
"""

from __future__ import annotations

import json
import sys
import tracemalloc

import deltastore as ds
from deltastore.replicate import ReplicationPolicy
from deltastore.storage import VersionStore


def main() -> None:
    src, dst_url, jobs, chunk, block = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    dst = VersionStore(dst_url, block_size=block)
    policy = ReplicationPolicy(chunk_bytes=chunk)
    tracemalloc.start()
    tracemalloc.reset_peak()
    report = ds.replicate(src, dst, jobs=jobs, verify=True, policy=policy)
    _, peak = tracemalloc.get_traced_memory()
    print(json.dumps({"peak": peak, "copied": list(report.copied)}))


if __name__ == "__main__":
    main()
