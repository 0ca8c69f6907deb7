"""OpenSSF Model Signing (OMS v1.0) signatures of bundles: the detached ``BUNDLE.sig`` that
``aotpack sign`` writes beside a bundle and a loader with a trust list accepts, byte-compatible with
the ``model_signing`` package (sigstore/model-transparency) that KServe and model registries use.

An OMS signature is a Sigstore bundle (JSON, media type v0.3) holding a DSSE envelope whose payload
is an in-toto Statement v1 of predicate type ``https://model_signing/signature/v1.0``. The predicate
lists each signed file's sha256 (``resources``) and how the files were enumerated
(``serialization``); the one subject's digest is the sha256 of the resources' digests concatenated
in order. The envelope is signed over DSSE's pre-authentication encoding (PAE) with the "key"
method: the bundle names the key by a hint (the sha256 of its PEM SubjectPublicKeyInfo, as
model_signing computes it; pre-1.1 signatures carry the PEM itself) and the verifier brings the key.

What aotpack signs: the ``.tpk`` file's bytes and a split weights file's. A bundle without split
weights is a single-file model, its one resource named ``.`` as model_signing 1.1 names it (the spec
says the file name; a verifier here accepts either); a bundle with split weights is signed as its
folder, the two files named by their names in it.

Keys are ``aot.signing``'s: Ed25519 (aotpack's default; model_signing 1.1 verifies ECDSA only) or
ECDSA P-256/P-384/P-521 with SHA-256/384/512 and DER signatures, as model_signing signs. Only the
"key" method is accepted: certificate and Sigstore keyless signatures need a CA or a transparency
log, which an offline, key-file based loader does not consult.

This module works on bytes and digests only, never on paths it would reopen: the loader hashes what
it reads and passes the digests in. ``cryptography`` is imported only to sign or verify.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aot import signing
from aot.errors import SignatureError

MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
DEPRECATED_PREDICATE_TYPE = "https://model_signing/Digests/v0.1"
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")  # what model_signing ignores by default
SINGLE_FILE = "."  # model_signing's name of the one resource of a single-file model
SUFFIX = ".sig"
# A signature of a folder of a few hundred files is ~100 kB; read no more than this of a hostile one
MAX_SIGNATURE_BYTES = 1 << 20
MAX_RESOURCES = 1 << 14
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class OmsSignature:
    """A decoded (not yet verified) OMS signature."""

    hint: str | None  # the signer's key hint, when the bundle names it so (OMS 1.0)
    pem: bytes | None  # the signer's PEM public key, in pre-1.1 signatures
    payload: bytes  # the signed in-toto statement
    signature: bytes  # over pae(payload)
    resources: dict[str, str]  # file name → sha256 hex

    def signer(self, trusted: Sequence[bytes]) -> bytes | None:
        """The trusted key (``aot.signing`` bytes) this signature names; None for another key."""
        if self.hint is not None:
            return next((k for k in trusted if key_hint(k) == self.hint), None)
        if self.pem is not None:
            key = signing.parse_public_pem(self.pem)
            return key if key in trusted else None
        # neither: model_signing verifies such a signature with the key it is given; so do we
        return next((k for k in trusted if verifies(k, self)), None)

    @property
    def signer_name(self) -> str:
        """How an error names the signer: the hint model_signing shows, or the key's fingerprint."""
        if self.hint is not None:
            return f"the key of OMS hint {self.hint[:16]}"
        key = None if self.pem is None else signing.parse_public_pem(self.pem)
        return "an unnamed key" if key is None else signing.fingerprint(key)


def signature_path(bundle: str | Path) -> Path:
    """Where a bundle's OMS signature lies: beside it, named ``BUNDLE.sig``."""
    bundle = Path(bundle)
    return bundle.with_name(bundle.name + SUFFIX)


def key_hint(public_key: bytes) -> str:
    """model_signing's name of a key: the sha256 hex of its PEM SubjectPublicKeyInfo."""
    return hashlib.sha256(signing.public_pem(public_key)).hexdigest()


def pae(payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding of an in-toto payload: what is signed."""
    return b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)


def root_digest(resources: Sequence[tuple[str, str]]) -> str:
    """The subject's digest: sha256 over the resources' digests (raw bytes) in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for _, d in resources)).hexdigest()


def statement(model_name: str, files: Mapping[str, str], ignore_paths: Sequence[str]) -> bytes:
    """The in-toto statement of ``files`` (name → sha256 hex), as the payload bytes."""
    resources = sorted(files.items())
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root_digest(resources)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "resources": [{"name": n, "digest": d, "algorithm": "sha256"} for n, d in resources],
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": sorted(ignore_paths),
            },
        },
    }
    return json.dumps(body, indent=2).encode()


def sign(private_key, model_name: str, files: Mapping[str, str], ignore_paths: Sequence[str]) -> bytes:
    """The OMS signature file's bytes: ``files`` (name → sha256 hex) signed with ``private_key``
    (an ``aot.signing.read_private_key`` key). Deterministic for Ed25519 keys."""
    payload = statement(model_name, files, ignore_paths)
    public_key = signing.public_bytes(private_key.public_key())
    if len(public_key) == 32:
        sig = private_key.sign(pae(payload))
    else:
        sig = private_key.sign(pae(payload), _ecdsa(private_key.curve.key_size))
    bundle = {
        "mediaType": MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(public_key)}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}],
        },
    }
    return json.dumps(bundle, separators=(",", ":")).encode()


def verifies(public_key: bytes, sig: OmsSignature) -> bool:
    """Whether ``sig`` is ``public_key``'s signature of its statement."""
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

    try:
        key = signing.public_key_object(public_key)
        if len(public_key) == 32:
            key.verify(sig.signature, pae(sig.payload))
        else:
            key.verify(sig.signature, pae(sig.payload), _ecdsa(key.curve.key_size))
    except (InvalidSignature, UnsupportedAlgorithm, ValueError, TypeError):
        return False
    return True


def mismatches(sig: OmsSignature, files: Mapping[str, str], model_file: str | None = None) -> list[str]:
    """The names of ``files`` (name → sha256 hex of the bytes that will be used) that ``sig`` does
    not list with that digest. ``model_file``: the file a single-file model's one resource (named
    ``.`` by model_signing) stands for. Resources beyond ``files`` are not used, so not checked."""
    resources = sig.resources
    if model_file is not None and set(resources) == {SINGLE_FILE}:
        resources = {model_file: resources[SINGLE_FILE]}
    return [name for name, digest in files.items() if resources.get(name) != digest]


def decode(data: bytes, where: str) -> OmsSignature:
    """An OMS signature file's bytes → ``OmsSignature``; anything but a well-formed OMS v1.0
    signature made with a key is a ``SignatureError`` that says what it is instead."""
    try:
        bundle = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        bundle = None
    if not isinstance(bundle, dict) or bundle.get("mediaType") != MEDIA_TYPE:
        _malformed(where, f"not a Sigstore bundle of media type {MEDIA_TYPE}")
    material = bundle.get("verificationMaterial")
    envelope = bundle.get("dsseEnvelope")
    if not isinstance(material, dict) or not isinstance(envelope, dict):
        _malformed(where, "its verificationMaterial or dsseEnvelope is missing")
    if "publicKey" not in material:
        kind = "an X.509 certificate" if "x509CertificateChain" in material else "Sigstore (keyless)"
        raise SignatureError(
            f"{where}: signed with {kind}; this loader trusts key files only: sign the bundle with a "
            f"private key (`aotpack sign BUNDLE --key KEY`, or `model_signing sign key`)"
        )
    hint, pem = _public_key(material["publicKey"], where)
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        _malformed(where, f"its DSSE payload type is not {PAYLOAD_TYPE}")
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures or not isinstance(signatures[0], dict):
        _malformed(where, "its DSSE envelope holds no signature")
    payload = _base64(envelope.get("payload"), where, "payload")
    sig = _base64(signatures[0].get("sig"), where, "signature")
    return OmsSignature(hint, pem, payload, sig, _resources(payload, where))


def _public_key(public_key: object, where: str) -> tuple[str | None, bytes | None]:
    if not isinstance(public_key, dict):
        _malformed(where, "its publicKey is not an object")
    hint = public_key.get("hint")
    if hint is not None:
        if not isinstance(hint, str) or not _HEX64.match(hint):
            _malformed(where, "its key hint is not a sha256 in hex")
        return hint, None
    raw = public_key.get("rawBytes")
    return None, None if raw is None else _base64(raw, where, "publicKey.rawBytes")


def _resources(payload: bytes, where: str) -> dict[str, str]:
    """The statement's resources (name → sha256 hex), once it is checked to be an OMS v1.0 one."""
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        body = None
    if not isinstance(body, dict) or body.get("_type") != STATEMENT_TYPE:
        _malformed(where, f"its payload is not an in-toto statement ({STATEMENT_TYPE})")
    kind = body.get("predicateType")
    if kind != PREDICATE_TYPE:
        hint = "; it is model_signing 0.2's deprecated format, re-sign it" * (
            kind == DEPRECATED_PREDICATE_TYPE
        )
        _malformed(where, f"its predicate type is {str(kind)[:80]!r}, not {PREDICATE_TYPE}{hint}")
    predicate, subject = body.get("predicate"), body.get("subject")
    serialization = predicate.get("serialization") if isinstance(predicate, dict) else None
    if not isinstance(serialization, dict):
        _malformed(where, "its predicate has no serialization")
    method, hash_type = serialization.get("method"), serialization.get("hash_type")
    if method != "files" or hash_type != "sha256":
        raise SignatureError(
            f"{where}: its files were hashed as {str(method)[:20]!r} with {str(hash_type)[:20]!r}; this "
            f"loader verifies whole files hashed with sha256 (model_signing's default: no --use-shards, "
            f"no --hash-algorithm), re-sign with those"
        )
    entries = predicate.get("resources")
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_RESOURCES:
        _malformed(where, f"its predicate lists no resources or more than {MAX_RESOURCES}")
    resources: dict[str, str] = {}
    for entry in entries:
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and entry.get("algorithm") == "sha256"
        )
        if not ok or not isinstance(entry.get("digest"), str) or not _HEX64.match(entry["digest"]):
            _malformed(where, "a resource is not a name with a sha256 digest in hex")
        if entry["name"] in resources:
            _malformed(where, f"resource {entry['name'][:80]!r} is listed twice")
        resources[entry["name"]] = entry["digest"]
    one = subject[0] if isinstance(subject, list) and len(subject) == 1 else None
    digest = one.get("digest") if isinstance(one, dict) else None
    if not isinstance(digest, dict):
        _malformed(where, "its statement has not exactly one subject with a digest")
    if digest.get("sha256") != root_digest([(e["name"], e["digest"]) for e in entries]):
        _malformed(where, "its subject's digest is not the digest of its resources")
    return resources


def _base64(value: object, where: str, what: str) -> bytes:
    try:
        if isinstance(value, str) and len(value) <= MAX_SIGNATURE_BYTES:
            return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        pass
    _malformed(where, f"its {what} is not base64")


def _malformed(where: str, what: str):
    raise SignatureError(
        f"{where}: not an OpenSSF Model Signing v1.0 signature ({what}); re-sign the bundle with "
        f"`aotpack sign` or `model_signing sign key`"
    )


def _ecdsa(key_size: int):
    """ECDSA with the hash model_signing pairs with the curve: SHA-256, -384, -512."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.ECDSA({256: hashes.SHA256(), 384: hashes.SHA384()}.get(key_size, hashes.SHA512()))
