"""Ed25519 key files: ``PREFIX.key`` (private, mode 0600) and ``PREFIX.pub`` (public).

Both are PEM, so standard tools read them (unencrypted PKCS#8 and SubjectPublicKeyInfo). A
key is named by its key id: the first 16 hex characters of the BLAKE3 digest of the raw 32-byte
public key. Trainers hold the private key; engines only public keys (several while keys
rotate). Without the optional ``cryptography`` package every function here raises a
:class:`ConfigError` saying ``pip install deltastore[sign]``.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import blake3

from deltastore.errors import ConfigError, InsecureKeyFileWarning

PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"
KEY_ID_CHARS = 16
_MAX_KEY_FILE = 64 * 1024


def require_cryptography() -> tuple[ModuleType, ModuleType]:
    """``(ed25519, serialization)`` from ``cryptography``, or a ConfigError naming the extra."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigError(
            "signed versions need the 'cryptography' package: pip install deltastore[sign]"
        ) from None
    return ed25519, serialization


def key_id_of(public_raw: bytes) -> str:
    """The key id of a raw 32-byte Ed25519 public key."""
    return blake3.blake3(public_raw).hexdigest()[:KEY_ID_CHARS]


@dataclass(frozen=True)
class TrustedKey:
    """A public key an engine accepts signatures from."""

    key_id: str
    public: Any  # cryptography's Ed25519PublicKey
    source: str = ""  # where it was loaded from (for messages)


@dataclass(frozen=True)
class SigningKey:
    """A private key a publisher signs versions with."""

    key_id: str
    private: Any  # cryptography's Ed25519PrivateKey
    source: str = ""

    def trusted(self) -> TrustedKey:
        return TrustedKey(self.key_id, self.private.public_key(), self.source)


@dataclass(frozen=True)
class KeyPairFiles:
    """What :func:`generate_keypair` wrote."""

    private_path: str
    public_path: str
    key_id: str


def _raw_public(public: Any) -> bytes:
    _, serialization = require_cryptography()
    raw: bytes = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def _write_new(path: str, data: bytes, mode: int) -> None:
    """Create ``path`` with exactly ``mode`` whatever the umask; never replace a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists; refusing to overwrite a key (pick another PREFIX)"
        ) from None
    except FileNotFoundError:
        raise ConfigError(f"cannot create {path}: its directory does not exist") from None
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def generate_keypair(prefix: str | os.PathLike[str]) -> KeyPairFiles:
    """Write a new Ed25519 key pair to ``PREFIX.key`` (mode 0600) and ``PREFIX.pub`` (0644),
    creating a missing directory; :class:`ConfigError` when either file exists."""
    ed25519, serialization = require_cryptography()
    base = os.fspath(prefix)
    parent = os.path.dirname(base)
    if parent:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the key directory {parent}: {exc}") from None
    private_path, public_path = base + PRIVATE_SUFFIX, base + PUBLIC_SUFFIX
    for path in (private_path, public_path):
        if os.path.lexists(path):
            raise ConfigError(f"{path} exists; refusing to overwrite a key (pick another PREFIX)")
    private = ed25519.Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600)
    _write_new(public_path, public_pem, 0o644)
    return KeyPairFiles(private_path, public_path, key_id_of(_raw_public(private.public_key())))


def _read_key_file(path: str, what: str, other_kind: bytes, refusal: str) -> bytes:
    """The PEM bytes of ``path``; a ConfigError ending in ``refusal`` when it holds the
    ``other_kind`` of key."""
    try:
        if os.path.getsize(path) > _MAX_KEY_FILE:
            raise ConfigError(f"{what} {path} is not a key file (over {_MAX_KEY_FILE} bytes)")
        with open(path, "rb") as fh:
            data = fh.read()
        if other_kind in data:
            raise ConfigError(f"{path} is a {refusal}")
        return data
    except FileNotFoundError:
        raise ConfigError(
            f"{what} {path} does not exist (create one with deltastore keygen)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None


def load_private_key(path: str | os.PathLike[str]) -> SigningKey:
    """Load ``PREFIX.key``; warns (:class:`InsecureKeyFileWarning`) when others may read it.
    :class:`ConfigError` unless it is an unencrypted Ed25519 private key in PEM."""
    ed25519, serialization = require_cryptography()
    where = os.fspath(path)
    data = _read_key_file(
        where, "signing key", b"PUBLIC KEY", "public key; signing needs the private PREFIX.key"
    )
    mode = stat.S_IMODE(os.stat(where).st_mode)
    if mode & 0o077:
        warnings.warn(
            f"signing key {where} has mode {mode:04o}: other users may read it; chmod 600 {where}",
            InsecureKeyFileWarning,
            stacklevel=2,
        )
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{where} is not an unencrypted PEM private key ({exc}); create one with "
            "deltastore keygen PREFIX"
        ) from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{where} holds a {type(private).__name__}, not an Ed25519 key")
    return SigningKey(key_id_of(_raw_public(private.public_key())), private, where)


def load_public_key(path: str | os.PathLike[str]) -> TrustedKey:
    """Load ``PREFIX.pub``; :class:`ConfigError` unless it is an Ed25519 public key in PEM
    (a private key is refused: engines must never hold one)."""
    ed25519, serialization = require_cryptography()
    where = os.fspath(path)
    refusal = "private key; engines trust the public PREFIX.pub, keep the .key on the trainer"
    data = _read_key_file(where, "trusted key", b"PRIVATE KEY", refusal)
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{where} is not a PEM public key ({exc}); pass the PREFIX.pub deltastore keygen wrote"
        ) from None
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise ConfigError(f"{where} holds a {type(public).__name__}, not an Ed25519 key")
    return TrustedKey(key_id_of(_raw_public(public)), public, where)


def as_trusted_keys(keys: Iterable[str | os.PathLike[str] | TrustedKey]) -> tuple[TrustedKey, ...]:
    """Public key files (or already loaded keys) → :class:`TrustedKey` values, in order;
    :class:`ConfigError` when none is given (an empty trust list would accept nothing)."""
    loaded = tuple(k if isinstance(k, TrustedKey) else load_public_key(k) for k in keys)
    if not loaded:
        raise ConfigError("trusted_keys is empty; pass at least one PREFIX.pub (--trust FILE)")
    return loaded


TrustedKeys = str | os.PathLike[str] | TrustedKey | Iterable[str | os.PathLike[str] | TrustedKey]
"""One public key file or key, or several (rotation)."""


def load_trusted(keys: TrustedKeys | None) -> tuple[TrustedKey, ...] | None:
    """``keys`` loaded (:class:`ConfigError` naming a bad file, or for an empty list); None
    when none were given (``trusted_keys=None``: versions need not be signed)."""
    if keys is None:
        return None
    if isinstance(keys, (str, os.PathLike, TrustedKey)):
        keys = [keys]
    return as_trusted_keys(keys)


def as_signing_key(key: str | os.PathLike[str] | SigningKey) -> SigningKey:
    """A private key file (or an already loaded key) → :class:`SigningKey`."""
    return key if isinstance(key, SigningKey) else load_private_key(key)
