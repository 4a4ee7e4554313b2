"""``deltastore keygen``: write an Ed25519 key pair for signed versions."""

from __future__ import annotations

import argparse
import json

from deltastore.cli.common import Subparsers, add_command


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "keygen",
        run,
        "write an Ed25519 key pair PREFIX.key (0600) and PREFIX.pub for signed versions",
        "Write a new Ed25519 key pair: PREFIX.key (PEM PKCS#8, mode 0600) stays with the "
        "trainer, which signs versions with it; PREFIX.pub (PEM) goes to every engine, which "
        "trusts it. Refuses to overwrite existing files. Needs pip install deltastore[sign].",
        json="machine-readable output",
        storage=False,
    )
    p.add_argument("prefix", help="path prefix of the two files (e.g. keys/run1)")


def run(args: argparse.Namespace) -> int:
    from deltastore.trust import generate_keypair

    files = generate_keypair(args.prefix)
    if args.json:  # without "ok": the object is the key pair
        paths = {"private_key": files.private_path, "public_key": files.public_path}
        print(json.dumps({**paths, "key_id": files.key_id}))
        return 0
    print(f"key id {files.key_id}")
    print(f"  private: {files.private_path} (mode 0600; keep it on the trainer)")
    print(f"  public:  {files.public_path} (give it to every engine: --trust)")
    return 0
