"""A pull in a child process, for the kill -9 trials.

Imports everything first and prints ``READY``; then reads one JSON line of arguments from stdin
(``local``, ``store``, ``target``, ``base``, ``workers``), prints ``GO`` and pulls. The parent
kills it at a random moment after ``GO``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from deltastore import pull_weights


def read_job() -> dict[str, Any] | None:
    """Say ``READY`` (everything imported), then read the job's JSON line from stdin; None
    when the parent closed stdin instead."""
    print("READY", flush=True)
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def main() -> int:
    args = read_job()
    if args is None:
        return 0
    print("GO", flush=True)
    result = pull_weights(
        args["local"], args["store"], args["target"], args["base"], workers=args["workers"]
    )
    print("DONE", json.dumps({"version": result.version, "action": result.action}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
