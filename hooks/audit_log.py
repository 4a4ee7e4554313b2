"""Example: an audit hook pair that appends one JSON line per call to a log file.

Use it as it is to see when and with what the trainer and the engines call their hooks, or as
a template for your own (a metrics push, a chat notification)::

    export DELTASTORE_AUDIT_LOG=/var/log/deltastore-hooks.jsonl
    --custom-update-weight-post-write-path hooks.audit_log.on_commit
    --custom-pull-weights-pre-read-hook hooks.audit_log.on_refresh

Hooks must be quick and must raise on failure: the trainer then reports the version as
published-but-not-announced, and the engine fails the pull loudly instead of reading stale
files.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

LOG_ENV = "DELTASTORE_AUDIT_LOG"


def _append(record: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        raise RuntimeError(f"set {LOG_ENV} to the file the audit hook appends to")
    record["time"] = time.time()
    record["pid"] = os.getpid()
    # One write() per line with O_APPEND: lines from concurrent ranks do not interleave.
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def on_commit(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """Post-write hook: record the version directory and the size of each file in it."""
    files = {
        name: os.path.getsize(os.path.join(version_dir, name))
        for name in sorted(os.listdir(version_dir))
        if os.path.isfile(os.path.join(version_dir, name))
    }
    _append({"hook": "commit", "version_dir": str(version_dir), "files": files})


def on_refresh(delta_dir: str, target_version: int) -> None:
    """Pre-read hook: record which version an engine host is about to read."""
    _append({"hook": "refresh", "delta_dir": str(delta_dir), "target_version": target_version})
