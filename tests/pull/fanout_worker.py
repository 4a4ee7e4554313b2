"""One rank of the fan-out test: pulls over a real gloo group on 127.0.0.1.

Arguments: a JSON object with ``rank``, ``world``, ``port``, ``store``, ``base``, ``dirs``
(the local dir of each rank: ranks sharing a dir stand for ranks on one host), ``corrupt_rank``,
``corrupt_tensor`` and ``out`` (where this rank writes its outcomes as JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch.distributed as dist

from deltastore import pull_weights
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.pull import GroupPullError
from tests.pull.helpers import write_tensor


def main() -> int:
    args = json.loads(sys.argv[1])
    rank, world = args["rank"], args["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=world
    )
    local = args["dirs"][rank]
    out: dict[str, object] = {}

    result = pull_weights(local, args["store"], 1, args["base"], process_group="world")
    out["v1"] = {"action": result.action, "group": [dataclasses.asdict(o) for o in result.group]}
    dist.barrier()

    if rank == args["corrupt_rank"]:
        name = args["corrupt_tensor"]
        size = scan_checkpoint(local)[name].entry.nbytes
        write_tensor(local, name, bytes([0xA5]) * size, keep_mtime=True)
    dist.barrier()
    try:
        result = pull_weights(local, args["store"], 2, args["base"], process_group="world")
        out["v2"] = {"success": True, "action": result.action}
    except GroupPullError as exc:
        out["v2"] = {
            "success": False,
            "message": str(exc),
            "failed_ranks": [o.rank for o in exc.failed],
            "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
        }
    with open(args["out"], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # torch's teardown of a gloo group at the interpreter's exit aborts now and then
    # ("terminate called without an active exception": 3 in 100 runs on a loaded 2-core box,
    # a barrier before destroy_process_group or not). This rank's outcome is in its JSON and
    # the group is destroyed; what torch's C++ destructors do at exit is not under test.
    os._exit(code)
