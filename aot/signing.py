"""Ed25519 signatures of bundles: key files, the signature member, fingerprints.

A bundle is signed over the exact bytes of its ``manifest.json``, which pins every other member's
sha256 and size (and the split weights file's), so one signature covers the whole bundle. The
signature member (``schema.SIGNATURE_PATH``) is small canonical JSON::

    {"algorithm": "ed25519", "public_key": "<base64, 32 bytes>", "signature": "<base64, 64 bytes>"}

The public key in it names the signer (``inspect`` shows its fingerprint); it is never trusted:
a loader with a trust list verifies with its own keys. Key files are PEM: the private key PKCS#8
(unencrypted, written with mode 0600), the public key SubjectPublicKeyInfo, as ``openssl genpkey
-algorithm ed25519`` and ``openssl pkey -pubout`` write them.

ECDSA keys (P-256, P-384, P-521) are keys too: ``model_signing`` signs with those only, so a bundle
signed in the OpenSSF Model Signing format (``aot.oms``) by another tool verifies with them. A public
key travels as bytes: an Ed25519 key raw (32 bytes, as the signature member holds it), an ECDSA key
as its DER SubjectPublicKeyInfo. The signature member stays Ed25519.

``cryptography`` is imported here only, and only when a key is read or a signature made or
checked: a loader without a trust list never needs it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from aot.errors import EnvError, SignatureError

ALGORITHM = "ed25519"
ECDSA_CURVES = ("secp256r1", "secp384r1", "secp521r1")  # P-256, P-384, P-521: the OMS key types
_KEY_TYPES = "an ed25519 or ECDSA (P-256, P-384, P-521)"
MAX_SIGNATURE_BYTES = 4096  # the member is ~170 bytes; read no more than this of a hostile one
INSTALL = "pip install 'aotpack[sign]'"
_FIELDS = {"algorithm", "public_key", "signature"}


@dataclass(frozen=True)
class Signature:
    public_key: bytes  # raw, 32 bytes
    signature: bytes  # 64 bytes, over the manifest's bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)


def fingerprint(public_key: bytes) -> str:
    """``ed25519:`` and the first 16 hex digits of the raw public key's sha256: what ``keygen``,
    ``sign`` and ``inspect`` print, to tell keys apart (trust compares whole keys). An ECDSA key's
    is ``ecdsa:`` and the first 16 of its OMS hint (the sha256 of its PEM), which model_signing
    writes into its signatures."""
    if len(public_key) == 32:
        return f"{ALGORITHM}:{hashlib.sha256(public_key).hexdigest()[:16]}"
    return f"ecdsa:{hashlib.sha256(public_pem(public_key)).hexdigest()[:16]}"


def public_pem(public_key: bytes) -> bytes:
    """The PEM SubjectPublicKeyInfo of a public key, byte for byte as ``cryptography`` (and so
    ``model_signing``) writes it: base64 of the DER in lines of 64."""
    der = _ED25519_SPKI_PREFIX + public_key if len(public_key) == 32 else public_key
    text = base64.b64encode(der).decode()
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return ("-----BEGIN PUBLIC KEY-----\n" + "\n".join(lines) + "\n-----END PUBLIC KEY-----\n").encode()


_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")  # DER before the raw 32-byte key


def public_bytes(key) -> bytes:
    """A ``cryptography`` public key → its bytes here: raw for Ed25519, DER SPKI for ECDSA."""
    ed25519, serialization = _crypto()
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def public_key_object(public_key: bytes):
    """The bytes of ``public_bytes`` → a ``cryptography`` public key."""
    ed25519, serialization = _crypto()
    if len(public_key) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(public_key)
    return serialization.load_der_public_key(public_key)


def _supported(key) -> bool:
    ed25519, _ = _crypto()
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey)):
        return True
    return isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)) and (
        key.curve.name in ECDSA_CURVES
    )


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise EnvError(
            f"signed bundles need the cryptography package, which is not installed; {INSTALL}"
        ) from None
    return ed25519, serialization


def encode(sig: Signature) -> bytes:
    """The signature member's bytes (canonical: the same signature is always the same bytes)."""
    fields = {
        "algorithm": ALGORITHM,
        "public_key": base64.b64encode(sig.public_key).decode(),
        "signature": base64.b64encode(sig.signature).decode(),
    }
    return (json.dumps(fields, sort_keys=True, indent=1) + "\n").encode()


def decode(data: bytes, where: str) -> Signature:
    """The signature member's bytes → ``Signature``; anything else is a ``SignatureError``."""
    try:
        fields = json.loads(data.decode("utf-8"))
        ok = isinstance(fields, dict) and set(fields) == _FIELDS and fields["algorithm"] == ALGORITHM
        key = base64.b64decode(fields["public_key"], validate=True) if ok else b""
        sig = base64.b64decode(fields["signature"], validate=True) if ok else b""
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError, binascii.Error):
        ok = False
    if not ok or len(key) != 32 or len(sig) != 64:
        raise SignatureError(
            f"{where}: its signature member is not an {ALGORITHM} signature aotpack wrote; "
            f"re-sign the bundle with `aotpack sign`"
        )
    return Signature(public_key=key, signature=sig)


def _read_key_file(path: str | os.PathLike, what: str) -> bytes:
    """A key file's bytes; a FIFO, device or folder is refused at once (O_NONBLOCK: opening a FIFO
    with no writer would wait forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise EnvError(
                    f"{what} {path}: not a regular file (a FIFO, device or folder); give the key file itself"
                )
            return f.read(1 << 16)
    except OSError as e:
        raise EnvError(
            f"{what} {path}: cannot be read ({e.strerror}); make a key pair with `aotpack keygen`"
        ) from None


def read_public_key(path: str | os.PathLike) -> bytes:
    """A PEM (SubjectPublicKeyInfo) public key file → its bytes (``public_bytes``)."""
    key = parse_public_pem(_read_key_file(path, "trusted key"))
    if key is None:
        raise EnvError(
            f"trusted key {path}: not {_KEY_TYPES} public key in PEM (BEGIN PUBLIC KEY); "
            f"trust the KEY.pub that `aotpack keygen` wrote, never the private key"
        )
    return key


def parse_public_pem(data: bytes) -> bytes | None:
    """A PEM SubjectPublicKeyInfo → the key's bytes (``public_bytes``); None when it is not a
    public key of a supported type."""
    _, serialization = _crypto()
    from cryptography.exceptions import UnsupportedAlgorithm

    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    return public_bytes(key) if _supported(key) else None


def read_private_key(path: str | os.PathLike):
    """A PEM (PKCS#8 or SEC1, unencrypted) Ed25519 or ECDSA private key file → the key."""
    _, serialization = _crypto()
    from cryptography.exceptions import UnsupportedAlgorithm

    data = _read_key_file(path, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        key = None
    if key is None or not _supported(key):
        raise EnvError(
            f"signing key {path}: not an unencrypted {_KEY_TYPES.removeprefix('an ')} private key in PEM "
            f"(BEGIN PRIVATE KEY); make one with `aotpack keygen -o KEY`"
        )
    return key


def is_ed25519(private_key) -> bool:
    ed25519, _ = _crypto()
    return isinstance(private_key, ed25519.Ed25519PrivateKey)


def sign(private_key, manifest: bytes) -> Signature:
    _, serialization = _crypto()
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return Signature(public_key=public, signature=private_key.sign(manifest))


def verifies(public_key: bytes, sig: Signature, manifest: bytes) -> bool:
    """Whether ``sig`` is ``public_key``'s signature of exactly these manifest bytes."""
    ed25519, _ = _crypto()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(sig.signature, manifest)
    except (InvalidSignature, ValueError):
        return False
    return True


KEY_ALGORITHMS = (ALGORITHM, "ecdsa-p256")  # what keygen makes: aotpack's default, model_signing's


def write_key_pair(path: str | os.PathLike, algorithm: str = ALGORITHM) -> str:
    """A new key pair: the private key at ``path`` (mode 0600, never overwritten) and the public
    key at ``path``.pub. Returns the key's fingerprint. ``algorithm``: one of ``KEY_ALGORITHMS``;
    ``ecdsa-p256`` for signatures that ``model_signing`` verifies too."""
    if algorithm not in KEY_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {KEY_ALGORITHMS}, got {algorithm!r}")
    ed25519, serialization = _crypto()
    path = Path(path)
    public_path = path.with_name(path.name + ".pub")
    for p in (path, public_path):
        if p.exists():
            raise EnvError(f"{p} exists; keygen never overwrites a key, choose another path or remove it")
    if algorithm == ALGORITHM:
        key = ed25519.Ed25519PrivateKey.generate()
    else:
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key()
    public_pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(private_pem)
        public_path.write_bytes(public_pem)
    except OSError as e:
        raise EnvError(f"cannot write the key pair at {path}: {e.strerror}") from None
    return fingerprint(public_bytes(public))
