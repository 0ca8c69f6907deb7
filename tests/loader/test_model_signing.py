"""OpenSSF Model Signing (OMS v1.0) signatures: ``aotpack sign`` writes ``BUNDLE.sig`` beside a
bundle, ``load(trust=...)`` accepts a bundle whose ``BUNDLE.sig`` a trusted key made, and both
interoperate with the ``model_signing`` package (sigstore/model-transparency) and pass the spec's
test vectors (``tests/data/oms``).

With a trust list, a bundle that carries no signature member but a ``BUNDLE.sig`` loads only when a
trusted key signed the ``.tpk``'s bytes (and its split weights file's); a foreign key is refused
from the signature file alone, a changed archive or signature with the same texts as the member's.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch

import aot.archive
import aot.detached
import aot.loader.bundle
from aot import oms, schema
from aot.errors import BundleError, SignatureError
from aot.loader import load
from aot.packager import pack
from aot.packager.sign import sign_bundle
from aot.signing import fingerprint, read_private_key, read_public_key, write_key_pair
from tests.conftest import DATA
from tests.hostile_util import (
    crc_patched,
    manifest_bytes,
    manifest_of,
    read_entries,
    write_entries,
)
from tests.test_cli import aotpack

pytest.importorskip("cryptography")

OMS_DATA = DATA / "oms"


def _ecdsa_key_pair(path: Path, curve: str = "secp256r1") -> None:
    """A PEM ECDSA key pair as ``openssl genpkey -algorithm EC`` writes it: ``path`` and ``path``.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1() if curve == "secp384r1" else ec.SECP256R1())
    pem = serialization.Encoding.PEM
    path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public = key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    path.with_name(path.name + ".pub").write_bytes(public)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Key pairs: ``ours`` (Ed25519), ``ec`` (P-256), ``ec384`` (P-384) and ``theirs`` (P-256, an
    attacker's)."""
    folder = tmp_path_factory.mktemp("keys")
    write_key_pair(folder / "ours")
    _ecdsa_key_pair(folder / "ec")
    _ecdsa_key_pair(folder / "ec384", "secp384r1")
    _ecdsa_key_pair(folder / "theirs")
    return folder


def _pub(keys, name: str) -> str:
    return str(keys / f"{name}.pub")


def _copy(built, folder: Path, name: str = "b.tpk") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(built("branchy").read_bytes())
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _runs(path: Path, trust: list[str]) -> None:
    runner = load(path, trust=trust)
    try:
        assert torch.equal(runner(**runner.example_inputs()), runner.reference_outputs()[0])
    finally:
        runner.bundle.close()


def _decoded(path: Path) -> tuple[dict, oms.OmsSignature]:
    data = oms.signature_path(path).read_bytes()
    sig = oms.decode(data, "x")
    return json.loads(sig.payload), sig


def test_an_ecdsa_key_writes_only_the_oms_signature_and_a_trusting_loader_runs_it(built, keys, tmp_path):
    path = _copy(built, tmp_path)
    before = path.read_bytes()
    fp = sign_bundle(path, keys / "ec")
    assert path.read_bytes() == before  # no signature member: it holds Ed25519 signatures only
    assert oms.signature_path(path) == tmp_path / "b.tpk.sig"
    public = read_public_key(_pub(keys, "ec"))
    assert fp == fingerprint(public) == f"ecdsa:{oms.key_hint(public)[:16]}"

    statement, sig = _decoded(path)
    # a single-file model as model_signing writes one: its one resource named "."
    assert statement["subject"] == [
        {"name": "b.tpk", "digest": {"sha256": hashlib.sha256(bytes.fromhex(_sha256(path))).hexdigest()}}
    ]
    assert statement["predicate"]["resources"] == [
        {"name": ".", "digest": _sha256(path), "algorithm": "sha256"}
    ]
    assert statement["predicate"]["serialization"] == {
        "method": "files",
        "hash_type": "sha256",
        "allow_symlinks": False,
        "ignore_paths": [".git", ".gitattributes", ".github", ".gitignore"],
    }
    assert sig.hint == oms.key_hint(public) and oms.verifies(public, sig)
    _runs(path, [_pub(keys, "ec")])
    _runs(path, [_pub(keys, "ours"), _pub(keys, "ec")])  # one of several trusted keys


def test_key_hints_are_model_signings(keys):
    """The OMS hint of a key is the sha256 of its PEM as ``cryptography`` writes it (model_signing's
    computation), for Ed25519 keys as for ECDSA ones."""
    for name in ("ours", "ec", "ec384"):
        pem = (keys / f"{name}.pub").read_bytes()
        assert oms.key_hint(read_public_key(keys / f"{name}.pub")) == hashlib.sha256(pem).hexdigest(), name


def test_an_ed25519_key_writes_the_member_and_a_deterministic_oms_signature(built, keys, tmp_path):
    path = _copy(built, tmp_path)
    sign_bundle(path, keys / "ours")
    assert schema.SIGNATURE_PATH in {e.name for e in read_entries(path.read_bytes())}
    first = oms.signature_path(path).read_bytes()
    sign_bundle(path, keys / "ours")
    assert oms.signature_path(path).read_bytes() == first  # Ed25519 and canonical JSON: the same bytes
    _, sig = _decoded(path)
    public = read_public_key(_pub(keys, "ours"))
    assert oms.verifies(public, sig) and sig.signer([public]) == public
    assert oms.mismatches(sig, {"b.tpk": _sha256(path)}, "b.tpk") == []  # the .tpk as written, member and all
    assert oms.mismatches(sig, {"b.tpk": _sha256(path)}) == ["b.tpk"]  # "." is the model file only
    # the member alone stripped: the loader falls back to BUNDLE.sig, which no longer matches the file
    entries = [e for e in read_entries(path.read_bytes()) if e.name != schema.SIGNATURE_PATH]
    path.write_bytes(write_entries(entries))
    with pytest.raises(SignatureError, match=r"does not match b\.tpk: the bundle was changed after signing"):
        load(path, trust=[_pub(keys, "ours")])


def _never(*args):
    raise AssertionError("the archive was read before its signature was known to be a trusted key's")


def test_a_foreign_key_is_refused_from_the_signature_file_alone(built, keys, tmp_path, monkeypatch):
    path = _copy(built, tmp_path)
    sign_bundle(path, keys / "ec")

    monkeypatch.setattr(aot.detached, "_hash_archive", _never)
    hint = oms.key_hint(read_public_key(_pub(keys, "ec")))
    theirs = fingerprint(read_public_key(_pub(keys, "theirs")))
    with pytest.raises(SignatureError) as e:
        load(path, trust=[_pub(keys, "theirs")])
    assert str(e.value) == (
        f"{path}: signed by the key of OMS hint {hint[:16]}, which is not a trusted key ({theirs}); "
        f"trust its public key (--trust / AOTPACK_TRUST) or re-sign the bundle with a trusted key"
    )


def test_a_changed_archive_or_signature_is_refused(built, keys, tmp_path, monkeypatch):
    path = _copy(built, tmp_path)
    sign_bundle(path, keys / "ec")
    ec = fingerprint(read_public_key(_pub(keys, "ec")))
    trust = [_pub(keys, "ec")]
    changed = "the bundle was changed after signing; rebuild and re-sign it, or re-copy the signed original"

    # one weights byte flipped and its CRC-32 fixed: the zip layer sees nothing, the signature does
    signed = path.read_bytes()
    weights = next(e.data for e in read_entries(signed) if e.name == schema.WEIGHTS_PATH)
    path.write_bytes(crc_patched(signed, schema.WEIGHTS_PATH, weights[:-1] + bytes([weights[-1] ^ 1])))
    with pytest.raises(SignatureError) as e:
        load(path, trust=trust)
    assert str(e.value) == f"{path}: its signature by {ec} does not match b.tpk: {changed}"

    # the statement changed to list the changed file's digest: the envelope's signature fails
    sig_path = oms.signature_path(path)
    bundle = json.loads(sig_path.read_bytes())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][0]["digest"] = _sha256(path)
    statement["subject"][0]["digest"]["sha256"] = oms.root_digest([(".", _sha256(path))])
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    sig_path.write_text(json.dumps(bundle))
    with monkeypatch.context() as m:  # refused from the signature file alone: its key hint is public
        m.setattr(aot.detached, "_hash_archive", _never)
        with pytest.raises(SignatureError) as e:
            load(path, trust=trust)
    assert str(e.value) == f"{path}: its signature by {ec} does not match {sig_path}: {changed}"

    # the signature removed: unsigned, as before
    sig_path.unlink()
    with pytest.raises(SignatureError, match="the bundle is not signed, and this loader trusts only"):
        load(path, trust=trust)


@pytest.mark.parametrize("key", ["ours", "ec"])  # the signature member's check, BUNDLE.sig's
def test_the_manifest_parsed_is_the_one_verified(built, keys, tmp_path, monkeypatch, key):
    """A second read of the manifest (a file swapped while the server loads it) is never parsed:
    the loader parses the bytes whose signature it checked."""
    path = _copy(built, tmp_path)
    sign_bundle(path, keys / key)
    entries = read_entries(path.read_bytes())
    widened = copy.deepcopy(manifest_of(entries))
    widened["guards"]["symbols"][1]["min"] = 1
    original = aot.archive.read_bounded

    def second_read(zf, info, size, where):
        if info.filename == schema.MANIFEST_PATH:
            return manifest_bytes(widened)
        return original(zf, info, size, where)

    monkeypatch.setattr(aot.archive, "read_bounded", second_read)
    runner = load(path, trust=[_pub(keys, key)])
    runner.bundle.close()
    assert (
        runner.bundle.manifest.guards.symbols[1].min
        == manifest_of(entries)["guards"]["symbols"][1]["min"]
        != 1
    )


def test_split_weights_are_signed_as_the_bundles_folder(built, keys, tmp_path):
    path = tmp_path / "model" / "b.tpk"
    path.parent.mkdir()
    manifest = pack(built.compiled("branchy"), path, split_weights=True)
    sign_bundle(path, keys / "ec")
    weights = path.with_name(manifest.external_weights)
    statement, _ = _decoded(path)
    assert statement["subject"][0]["name"] == "model"
    assert statement["predicate"]["resources"] == [
        {"name": "b.tpk", "digest": _sha256(path), "algorithm": "sha256"},
        {"name": weights.name, "digest": _sha256(weights), "algorithm": "sha256"},
    ]
    assert "b.tpk.sig" in statement["predicate"]["serialization"]["ignore_paths"]
    _runs(path, [_pub(keys, "ec")])

    # a signature of the .tpk that lists other weights is refused before they are read
    other = {"b.tpk": _sha256(path), weights.name: "0" * 64}
    key = read_private_key(keys / "ec")
    oms.signature_path(path).write_bytes(oms.sign(key, "model", other, oms.GIT_PATHS))
    with pytest.raises(SignatureError, match=f"does not match {weights.name}: the bundle was changed"):
        load(path, trust=[_pub(keys, "ec")])
    # ... and one that lists no weights at all
    oms.signature_path(path).write_bytes(oms.sign(key, "b.tpk", {".": _sha256(path)}, oms.GIT_PATHS))
    with pytest.raises(SignatureError, match=f"does not match {weights.name}"):
        load(path, trust=[_pub(keys, "ec")])

    # weights changed after signing: the manifest the signature covers pins them
    sign_bundle(path, keys / "ec")
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    before = path.read_bytes(), oms.signature_path(path).read_bytes()
    for key in ("ec", "ours"):  # nor is such a bundle signed: nothing is written
        with pytest.raises(BundleError, match="checksum mismatch in its weights file"):
            sign_bundle(path, keys / key)
        assert (path.read_bytes(), oms.signature_path(path).read_bytes()) == before
    with pytest.raises(BundleError, match="checksum mismatch in 'weights.safetensors'"):
        load(path, trust=[_pub(keys, "ec")])


# -- the spec's test vectors (ossf/model-signing-spec test-vectors/v1.0) -------------------------


def _vector(name: str) -> bytes:
    return (OMS_DATA / "vectors" / name).read_bytes()


def _signme() -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted((OMS_DATA / "model").iterdir())}


def test_the_specs_valid_key_vector_verifies_with_its_key(keys):
    key = read_public_key(OMS_DATA / "signing-key-pub.pem")  # P-384
    sig = oms.decode(_vector("valid-key.bundle.json"), "key.bundle.json")
    assert sig.hint == oms.key_hint(key) == "e8450dec4eb99dae995da9af1bc2cc9f76ed669ee2e744f57abba763df3e3f8e"
    assert sig.signer([read_public_key(_pub(keys, "ec"))]) is None and sig.signer([key]) == key
    assert oms.verifies(key, sig)
    assert oms.mismatches(sig, _signme()) == []
    assert oms.mismatches(sig, {**_signme(), "signme-2": "0" * 64}) == ["signme-2"]
    # model_signing 1.0's form: the key's PEM in rawBytes, a single file named "."
    sig = oms.decode(_vector("model-signing-1.0.0-rawbytes.sig"), "model.sig")
    assert sig.hint is None and sig.signer([key]) == key and oms.verifies(key, sig)
    assert oms.mismatches(sig, {"signme-1": _signme()["signme-1"]}, "signme-1") == []


@pytest.mark.parametrize(
    "vector, message",
    [
        (
            "valid-certificate.bundle.json",
            "signed with an X.509 certificate; this loader trusts key files only",
        ),
        (
            "valid-sigstore.bundle.json",
            r"signed with Sigstore \(keyless\); this loader trusts key files only",
        ),
        ("invalid-missing-tlog-entries.bundle.json", r"signed with Sigstore \(keyless\)"),
        ("invalid-empty.bundle.json", "not a Sigstore bundle of media type application/vnd.dev.sigstore"),
        ("invalid-missing-envelope.bundle.json", "its verificationMaterial or dsseEnvelope is missing"),
        (
            "invalid-missing-verification-material.bundle.json",
            "verificationMaterial or dsseEnvelope is missing",
        ),
        (
            "invalid-payload-wrong-predicate.bundle.json",
            "its predicate type is 'https://example.com/wrong-predicate/v1.0', not https://model_signing/signature/v1.0",
        ),
    ],
)
def test_the_specs_other_vectors_are_refused(vector, message):
    with pytest.raises(SignatureError, match=f"^x: .*{message}"):
        oms.decode(_vector(vector), "x")


def test_aotpack_signatures_validate_against_the_spec_schemas(built, keys, tmp_path):
    pytest.importorskip("jsonschema")
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    schemas = {p.name: json.loads(p.read_text()) for p in (OMS_DATA / "schemas").iterdir()}
    registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s, default_specification=DRAFT202012)) for s in schemas.values()
    )
    bundle_schema = Draft202012Validator(schemas["bundle.schema.json"], registry=registry)
    statement_schema = Draft202012Validator(schemas["statement.schema.json"], registry=registry)
    assert not bundle_schema.is_valid(json.loads(_vector("invalid-missing-envelope.bundle.json")))
    for key in ("ours", "ec"):
        path = _copy(built, tmp_path / key)
        sign_bundle(path, keys / key)
        bundle = json.loads(oms.signature_path(path).read_bytes())
        bundle_schema.validate(bundle)
        statement_schema.validate(json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"])))


# -- hostile signature files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff" * 100, "not a Sigstore bundle"),
        (b"[" * 100_000, "not a Sigstore bundle"),
        (b" " * (oms.MAX_SIGNATURE_BYTES + 1), f"more than {oms.MAX_SIGNATURE_BYTES} bytes; not a signature"),
        (
            json.dumps(
                {
                    "mediaType": oms.MEDIA_TYPE,
                    "verificationMaterial": {"publicKey": {"hint": "0" * 64}},
                    "dsseEnvelope": {
                        "payloadType": oms.PAYLOAD_TYPE,
                        "payload": base64.b64encode(b"[" * 100_000).decode(),
                        "signatures": [{"sig": ""}],
                    },
                }
            ).encode(),
            "its payload is not an in-toto statement",
        ),
    ],
    ids=["not-utf8", "deep-json", "oversized", "deep-payload"],
)
def test_a_hostile_signature_file_is_refused(built, keys, tmp_path, content, message):
    path = _copy(built, tmp_path)
    oms.signature_path(path).write_bytes(content)
    with pytest.raises(SignatureError, match=message):
        load(path, trust=[_pub(keys, "ec")])


def test_a_fifo_named_as_the_signature_does_not_block(built, keys, tmp_path):
    path = _copy(built, tmp_path)
    os.mkfifo(oms.signature_path(path))
    errors: list[BaseException] = []

    def attempt():
        try:
            load(path, trust=[_pub(keys, "ec")])
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            errors.append(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=120)  # a hang guard far above the milliseconds it takes
    assert not thread.is_alive(), "loading blocked on a FIFO named BUNDLE.sig"
    assert isinstance(errors[0], SignatureError) and "not a regular file" in str(errors[0])
    sign_bundle(path, keys / "ours")  # the signature member, when it verifies, needs no BUNDLE.sig
    os.unlink(oms.signature_path(path))
    os.mkfifo(oms.signature_path(path))
    _runs(path, [_pub(keys, "ours")])


# -- interoperability with the model_signing package -------------------------------------------


def _model_signing():
    return pytest.importorskip("model_signing", reason="the model-signing package (the test extra)")


def test_model_signing_verifies_what_aotpack_signs(built, keys, tmp_path):
    ms = _model_signing()
    verifier = ms.verifying.Config().use_elliptic_key_verifier(public_key=_pub(keys, "ec"))
    path = _copy(built, tmp_path / "single")
    sign_bundle(path, keys / "ec")
    verifier.verify(path, oms.signature_path(path))

    split = tmp_path / "split" / "b.tpk"
    split.parent.mkdir()
    pack(built.compiled("branchy"), split, split_weights=True)
    sign_bundle(split, keys / "ec")
    verifier.verify(split.parent, oms.signature_path(split))  # the folder: the .tpk, its weights

    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError, match="Signature mismatch"):
        verifier.verify(path, oms.signature_path(path))

    write_key_pair(tmp_path / "made", "ecdsa-p256")  # aotpack keygen --algorithm ecdsa-p256
    path = _copy(built, tmp_path / "made-by-keygen")
    sign_bundle(path, tmp_path / "made")
    ms.verifying.Config().use_elliptic_key_verifier(public_key=tmp_path / "made.pub").verify(
        path, oms.signature_path(path)
    )


@pytest.mark.parametrize("key", ["ec", "ec384"])
def test_aotpack_loads_what_model_signing_signs(built, keys, tmp_path, key):
    ms = _model_signing()
    signer = ms.signing.Config().use_elliptic_key_signer(private_key=keys / key)
    path = _copy(built, tmp_path / "single")
    signer.sign(path, oms.signature_path(path))
    _runs(path, [_pub(keys, key)])

    split = tmp_path / "split" / "b.tpk"
    split.parent.mkdir()
    pack(built.compiled("branchy"), split, split_weights=True)
    signer.sign(split.parent, oms.signature_path(split))
    _runs(split, [_pub(keys, key)])

    with pytest.raises(SignatureError, match="which is not a trusted key"):
        load(path, trust=[_pub(keys, "theirs")])
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SignatureError, match="does not match b.tpk: the bundle was changed after signing"):
        load(path, trust=[_pub(keys, key)])


@pytest.mark.slow
def test_cli_keygen_sign_and_load_with_an_ecdsa_key(built, tmp_path):
    path, key = _copy(built, tmp_path), tmp_path / "ec"
    r = aotpack("keygen", "--algorithm", "ecdsa-p256", "-o", str(key))
    fp = fingerprint(read_public_key(f"{key}.pub"))
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        0,
        f"wrote {key} (private: keep it secret) and {key}.pub (public), key {fp}",
    )
    assert fp.startswith("ecdsa:") and (key.stat().st_mode & 0o777) == 0o600
    r = aotpack("sign", str(path), "--key", str(key))
    assert (r.returncode, r.stderr.splitlines()[:2]) == (
        0,
        [f"signed {path} with key {fp}", f"wrote {path}.sig (OpenSSF Model Signing v1.0)"],
    ), r.stderr
    r = aotpack("load", str(path), "--trust", f"{key}.pub", "--runs", "1")
    assert r.returncode == 0 and "max abs error 0" in r.stdout, r.stderr
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    r = aotpack("load", str(path), "--trust", f"{key}.pub")
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        1,
        f"error: {path}: its signature by {fp} does not match b.tpk: the bundle was changed after "
        f"signing; rebuild and re-sign it, or re-copy the signed original",
    )
