"""A pre-read hook that holds a pull for a while (loaded by import path by the server test)."""

from __future__ import annotations

import os
import time


def hold(source_dir: str, target_version: int) -> None:
    """Sleep ``$DELTASTORE_TEST_HOLD_S`` seconds (default 2) before the version is read."""
    time.sleep(float(os.environ.get("DELTASTORE_TEST_HOLD_S", "2")))
