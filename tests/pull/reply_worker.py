"""A pull with ``flush_after_reply=True`` in a child process, for the kill -9 trials between the
reply and durability.

Imports everything and prints ``READY``; reads one JSON line (``local``, ``store``, ``target``,
``base``, ``hold_s``), prints ``GO``, pulls, prints ``REPLIED`` when ``pull_weights`` returns,
then waits for the flush-and-record thread. ``hold_s`` delays each msync of a patched file in
this child (a slow disk), so a kill sent after ``REPLIED`` lands before the data is durable.
"""

from __future__ import annotations

import json
import sys
import time

from pull_worker import read_job  # beside this script (run as a file, its dir is on the path)

import deltastore.pull.local as pull_local
from deltastore import pull_weights
from deltastore.pull import wait_durable


def main() -> int:
    args = read_job()
    if args is None:
        return 0
    real_msync = pull_local.msync

    def slow_msync(mm, path):  # type: ignore[no-untyped-def]
        time.sleep(args["hold_s"])
        real_msync(mm, path)

    pull_local.msync = slow_msync
    print("GO", flush=True)
    result = pull_weights(
        args["local"],
        args["store"],
        args["target"],
        args["base"],
        workers=1,
        flush_after_reply=True,
    )
    print("REPLIED", json.dumps({"version": result.version, "action": result.action}), flush=True)
    wait_durable(args["local"])
    print("DURABLE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
