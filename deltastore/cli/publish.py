"""``deltastore publish``: publish the change between two checkpoint directories."""

from __future__ import annotations

import argparse
import os

from deltastore.cli.common import (
    Subparsers,
    add_codec_flags,
    add_command,
    byte_progress,
    emit,
    fields,
    open_store,
    phase,
)
from deltastore.codecs import get_checksum
from deltastore.errors import ConfigError, IntegrityError, PublishError, VersionConflictError
from deltastore.format.checkpoint import read_tensor, scan_checkpoint
from deltastore.publish import DeltaPublisher, Snapshot
from deltastore.storage import VersionStore
from deltastore.storage.chain import walk_chain


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "publish",
        run,
        "publish the change from checkpoint PREV to checkpoint NEW as version latest+1",
        "Publish version latest+1 (1 on an empty store) holding the change from PREV (the "
        "state of the latest version) to NEW. Continues the latest version's stream and "
        "refuses a PREV that contradicts any digest the chain records.",
    )
    p.add_argument("--store", required=True, help="store URL: a directory, memory://, s3://, gs://")
    p.add_argument("--prev", required=True, help="checkpoint dir of the latest version's state")
    p.add_argument("--new", required=True, help="checkpoint dir holding the state to publish")
    add_codec_flags(p)
    p.add_argument(
        "--full", action="store_true", help="publish a full checkpoint (resets the chain)"
    )
    p.add_argument("--workers", type=int, help="encode threads (default: cores, ≤8)")
    p.add_argument(
        "--sign-key",
        metavar="FILE",
        help="PREFIX.key from `deltastore keygen`: sign the version (engines check with --trust)",
    )
    p.add_argument(
        "--require-signed",
        action="store_true",
        help="refuse to publish without --sign-key into a store whose latest version is signed "
        "(without it: a warning)",
    )


def check_prev_against_chain(store: VersionStore, prev_dir: str, latest: int) -> int:
    """Refuse a PREV whose tensors contradict a digest recorded on the latest version's chain
    (a wrong PREV would silently corrupt every later version); the number of tensors checked."""
    if latest == 0:
        return 0
    start, deltas = walk_chain(store, latest)
    recorded: dict[str, tuple[str, str, int]] = {}
    sources = ([start] if start is not None else []) + deltas
    for index in sources:
        for shard in index.shards():
            header = store.read_shard_header(index.version, shard)
            for name in header.tensors:
                digest = header.metadata.get(name)
                if digest is not None and index.checksum:
                    recorded[name] = (index.checksum, digest, index.version)
    tensors = scan_checkpoint(prev_dir)
    if start is not None:
        # A full version records the complete tensor set from there on (deltas change bytes,
        # never names): a PREV outside it is another model, whose changes no host can apply.
        extra = sorted(set(tensors) - set(start.weight_map))
        missing = sorted(set(start.weight_map) - set(tensors))
        if extra or missing:
            raise ConfigError(
                f"--prev {prev_dir} does not hold the tensors of weight_v{start.version:06d} "
                f"(the full version weight_v{latest:06d} builds on): extra {extra[:5]}, "
                f"missing {missing[:5]}"
            )
    for name, (algorithm, digest, version) in sorted(recorded.items()):
        tensor = tensors.get(name)
        if tensor is None:
            raise ConfigError(
                f"--prev {prev_dir} lacks tensor {name!r}, which weight_v{version:06d} records"
            )
        actual = get_checksum(algorithm).hexdigest(read_tensor(tensor, name))
        if actual != digest:
            raise IntegrityError(
                f"--prev {prev_dir} is not the state of weight_v{latest:06d}: tensor {name!r} "
                f"differs from the digest weight_v{version:06d} records; pass the checkpoint "
                "the latest version describes (or `deltastore pull` it first)"
            )
    return len(recorded)


def _read_new(publisher: DeltaPublisher, new: str) -> Snapshot:
    """--new as a lazily read snapshot; :class:`PublishError` when it lacks a tensor of --prev
    or holds one of another dtype or shape."""
    assert publisher.snapshot is not None
    target = Snapshot.from_checkpoint(new)
    missing = sorted(set(publisher.snapshot) - set(target))
    if missing:
        raise PublishError(f"--new {new} lacks tensors of --prev: {missing[:5]}")
    for name, tensor in target.tensors.items():
        base = publisher.snapshot.tensors.get(name)
        if base is not None and (base.dtype, base.shape) != (tensor.dtype, tensor.shape):
            raise PublishError(
                f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)} in --new but "
                f"{base.dtype}{list(base.shape)} in --prev"
            )
    return target


def run(args: argparse.Namespace) -> int:
    store = open_store(args, args.store)
    prev, new = os.path.abspath(args.prev), os.path.abspath(args.new)
    latest = store.latest()
    with phase(args, f"checking --prev against weight_v{latest:06d}'s chain"):
        checked = check_prev_against_chain(store, prev, latest)
    publisher = DeltaPublisher(
        store,
        prev,
        encoding=args.encoding,
        checksum=args.checksum,
        workers=args.workers,
        signing_key=args.sign_key,
        require_signed=args.require_signed,
    )
    with byte_progress(args, f"seeding from --prev {prev}") as progress:
        publisher.seed(continue_latest=True, progress=progress)
    if publisher.next_version != latest + 1:
        # Another publisher committed after --prev was checked against weight_v{latest}.
        raise VersionConflictError(
            f"{store.url} moved from weight_v{latest:06d} to "
            f"weight_v{publisher.next_version - 1:06d} while --prev was being checked; another "
            "publisher is writing to this store. Pull the latest version and publish again"
        )
    target = _read_new(publisher, new)
    what = f"publishing weight_v{publisher.next_version:06d} to {store.url}"
    with byte_progress(args, what) as progress:
        result = publisher.publish(
            ((name, t.data) for name, t in target.tensors.items()),
            full=args.full,
            progress=progress,
        )
    names = "version kind tensors_changed density changed_bytes total_bytes wire_bytes"
    return emit(
        args,
        {"url": store.url, **fields(result, names), "prev_digests_checked": checked},
        f"published weight_v{result.version:06d} ({result.kind}) to {store.url}: "
        f"{result.tensors_changed} tensors changed, density {result.density:.4%}, "
        f"{result.wire_bytes} wire bytes; --prev checked against {checked} recorded digests",
    )
