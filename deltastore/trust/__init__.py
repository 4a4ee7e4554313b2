"""Signed versions: the canonical manifest of a version, Ed25519 signing and verification
(``cryptography``, the optional extra ``sign``), and key files. See docs/signing.md.

A publisher signs with :func:`sign_manifest` and stores the record with :func:`signed_index`;
a reader checks it with :func:`verify_index` (or :func:`verify_manifest`) before it writes a
byte, then each shard's bytes with :meth:`SignatureRecord.check_shard`.
"""

from deltastore.errors import InsecureKeyFileWarning
from deltastore.trust.keys import (
    KeyPairFiles,
    SigningKey,
    TrustedKey,
    as_signing_key,
    as_trusted_keys,
    generate_keypair,
    key_id_of,
    load_private_key,
    load_public_key,
)
from deltastore.trust.manifest import (
    MANIFEST_DOMAIN,
    MANIFEST_FORMAT,
    ShardFact,
    ShardHasher,
    TensorFact,
    VersionManifest,
    build_manifest,
)
from deltastore.trust.sign import (
    SIGNATURE_KEY,
    SignatureRecord,
    sign_manifest,
    signed_index,
    unsigned_index,
    verify_index,
    verify_manifest,
)

__all__ = [
    "MANIFEST_DOMAIN",
    "MANIFEST_FORMAT",
    "SIGNATURE_KEY",
    "InsecureKeyFileWarning",
    "KeyPairFiles",
    "ShardFact",
    "ShardHasher",
    "SignatureRecord",
    "SigningKey",
    "TensorFact",
    "TrustedKey",
    "VersionManifest",
    "as_signing_key",
    "as_trusted_keys",
    "build_manifest",
    "generate_keypair",
    "key_id_of",
    "load_private_key",
    "load_public_key",
    "sign_manifest",
    "signed_index",
    "unsigned_index",
    "verify_index",
    "verify_manifest",
]
