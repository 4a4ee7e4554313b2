"""``deltastore keygen``: write an Ed25519 key pair for signed versions."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keygen",
        help="write an Ed25519 key pair PREFIX.key (0600) and PREFIX.pub for signed versions",
        description=(
            "Write a new Ed25519 key pair: PREFIX.key (PEM PKCS#8, mode 0600) stays with the "
            "trainer, which signs versions with it; PREFIX.pub (PEM) goes to every engine, which "
            "trusts it. Refuses to overwrite existing files. Needs pip install deltastore[sign]."
        ),
    )
    p.add_argument("prefix", help="path prefix of the two files (e.g. keys/run1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deltastore.trust import generate_keypair

    files = generate_keypair(args.prefix)
    if args.json:
        print(
            json.dumps(
                {
                    "private_key": files.private_path,
                    "public_key": files.public_path,
                    "key_id": files.key_id,
                }
            )
        )
        return 0
    print(f"key id {files.key_id}")
    print(f"  private: {files.private_path} (mode 0600; keep it on the trainer)")
    print(f"  public:  {files.public_path} (give it to every engine: --trust)")
    return 0
