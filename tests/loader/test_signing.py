"""Signed bundles: ``aotpack keygen`` → ``aotpack sign`` → ``load(trust=...)``.

With a trust list, a bundle loads only when one of the trusted keys signed its exact manifest
bytes; unsigned, foreign-key and tampered bundles are refused with one ``SignatureError`` line
before anything but the zip directory, the manifest's bytes and the signature member is read.
Without one, signed bundles load as before.
"""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

import aot.loader.bundle
from aot import schema
from aot.errors import BundleError, BundleWarning, EnvError, SignatureError
from aot.loader import load
from aot.packager import pack, write_archive
from aot.packager.sign import sign_bundle
from aot.signing import fingerprint, read_public_key, write_key_pair
from tests.hostile_util import (
    crc_patched,
    manifest_bytes,
    manifest_of,
    read_entries,
    with_manifest_text,
    with_member,
    write_entries,
)
from tests.test_cli import aotpack

pytest.importorskip("cryptography")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key pairs: ``ours`` (trusted) and ``theirs`` (an attacker's)."""
    folder = tmp_path_factory.mktemp("keys")
    write_key_pair(folder / "ours")
    write_key_pair(folder / "theirs")
    return folder


@pytest.fixture
def signed(tmp_path, built, keys):
    path = tmp_path / "signed.tpk"
    path.write_bytes(built("branchy").read_bytes())
    sign_bundle(path, keys / "ours")
    return path


def _trust(keys, *names: str) -> list[str]:
    return [str(keys / f"{n}.pub") for n in names]


def _outputs(runner):
    try:
        return runner(**runner.example_inputs()), runner.reference_outputs()
    finally:
        runner.bundle.close()


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    fp = write_key_pair(tmp_path / "k")
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    assert (tmp_path / "k").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert (tmp_path / "k.pub").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert fingerprint(read_public_key(tmp_path / "k.pub")) == fp
    before = (tmp_path / "k").read_bytes()
    with pytest.raises(EnvError, match="never overwrites"):
        write_key_pair(tmp_path / "k")
    assert (tmp_path / "k").read_bytes() == before


def test_a_signed_bundle_loads_with_trust_and_without(signed, keys):
    out, reference = _outputs(load(signed, trust=_trust(keys, "ours")))
    assert torch.equal(out, reference[0])
    out, reference = _outputs(load(signed, trust=_trust(keys, "theirs", "ours")))  # rotation: both trusted
    assert torch.equal(out, reference[0])
    out, reference = _outputs(load(signed))
    assert torch.equal(out, reference[0])


def test_an_unsigned_bundle_is_refused_before_anything_is_parsed(built, keys, monkeypatch):
    opened: list[str] = []
    original_open = zipfile.ZipFile.open

    def recording_open(self, name, *args, **kwargs):
        opened.append(name if isinstance(name, str) else name.filename)
        return original_open(self, name, *args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("the bundle was verified and parsed before its signature was checked")

    monkeypatch.setattr(zipfile.ZipFile, "open", recording_open)
    monkeypatch.setattr(aot.loader.bundle, "_verify", never)
    path = built("branchy")
    ours = fingerprint(read_public_key(keys / "ours.pub"))
    with pytest.raises(SignatureError) as e:
        load(path, trust=_trust(keys, "ours"))
    assert str(e.value) == (
        f"{path}: the bundle is not signed, and this loader trusts only bundles signed by {ours}; "
        f"sign it with `aotpack sign {path} --key KEY`"
    )
    assert opened == []


def test_a_foreign_key_is_refused_reading_only_the_signature(signed, keys, monkeypatch):
    opened: list[str] = []
    original_open = zipfile.ZipFile.open
    monkeypatch.setattr(
        zipfile.ZipFile,
        "open",
        lambda self, name, *a, **k: (
            opened.append(getattr(name, "filename", name)) or original_open(self, name, *a, **k)
        ),
    )
    theirs = fingerprint(read_public_key(keys / "theirs.pub"))
    ours = fingerprint(read_public_key(keys / "ours.pub"))
    with pytest.raises(SignatureError, match=f"signed by {ours}, which is not a trusted key \\({theirs}\\)"):
        load(signed, trust=_trust(keys, "theirs"))
    assert opened == [schema.SIGNATURE_PATH]


def _resigned_by_attacker(path, keys, entries) -> None:
    path.write_bytes(write_entries(entries))
    sign_bundle(path, keys / "theirs")


def test_tampered_bundles_are_refused(signed, keys, tmp_path):
    entries = read_entries(signed.read_bytes())
    trust = _trust(keys, "ours")

    # the manifest changed after signing: a guard widened
    m = copy.deepcopy(manifest_of(entries))
    m["guards"]["symbols"][1]["min"] = 1
    widened = tmp_path / "widened.tpk"
    widened.write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(m))))
    with pytest.raises(
        SignatureError, match="does not match its manifest: the bundle was changed after signing"
    ):
        load(widened, trust=trust)

    # a member rewritten and re-checksummed in the manifest, as an attacker who knows the format would
    guards = next(e.data for e in entries if e.name == schema.GUARDS_PATH)
    rewritten = tmp_path / "rewritten.tpk"
    rewritten.write_bytes(write_entries(with_member(entries, schema.GUARDS_PATH, guards + b"# ok\n")))
    with pytest.raises(SignatureError, match="does not match its manifest"):
        load(rewritten, trust=trust)

    # ... and then signed with the attacker's own key
    _resigned_by_attacker(rewritten, keys, with_member(entries, schema.GUARDS_PATH, guards + b"# ok\n"))
    with pytest.raises(SignatureError, match="which is not a trusted key"):
        load(rewritten, trust=trust)

    # a member changed, the manifest not: the signature holds and the checksum check catches it
    weights = next(e.data for e in entries if e.name == schema.WEIGHTS_PATH)
    flipped = weights[:-1] + bytes([weights[-1] ^ 1])
    patched = tmp_path / "patched.tpk"
    patched.write_bytes(crc_patched(signed.read_bytes(), schema.WEIGHTS_PATH, flipped))
    with pytest.raises(BundleError, match="checksum mismatch in 'weights.safetensors'") as e:
        load(patched, trust=trust)
    assert not isinstance(e.value, SignatureError)


@pytest.mark.parametrize(
    "member, message",
    [
        (b"not json", "its signature member is not an ed25519 signature aotpack wrote"),
        (b'{"algorithm": "rsa", "public_key": "", "signature": ""}', "is not an ed25519 signature"),
        (b"[" * 4000, "is not an ed25519 signature"),
        (b" " * 5000, "member signature.json is 5000 bytes \\(limit 4096\\)"),
    ],
)
def test_a_malformed_signature_member_is_refused(signed, keys, tmp_path, member, message):
    path = tmp_path / "bad.tpk"
    path.write_bytes(
        write_entries(
            with_member(read_entries(signed.read_bytes()), schema.SIGNATURE_PATH, member, resign=False)
        )
    )
    with pytest.raises(SignatureError, match=message):
        load(path, trust=_trust(keys, "ours"))


def test_the_environment_sets_trust_for_a_whole_server(signed, built, keys, monkeypatch):
    monkeypatch.setenv("AOTPACK_TRUST", os.pathsep.join(_trust(keys, "theirs", "ours")))
    out, reference = _outputs(load(signed))
    assert torch.equal(out, reference[0])
    with pytest.raises(SignatureError, match="the bundle is not signed"):
        load(built("branchy"))
    monkeypatch.setenv("AOTPACK_TRUST", _trust(keys, "theirs")[0])
    with pytest.raises(SignatureError, match="which is not a trusted key"):
        load(signed)
    # an empty list names no key of its own: the server's trust list still holds
    with pytest.raises(SignatureError, match="the bundle is not signed"):
        load(built("branchy"), trust=[])


def test_the_manifest_checked_is_the_manifest_parsed(signed, keys, monkeypatch):
    """Whoever can rewrite the file while it loads swaps the manifest between reads: every member
    is read once, and the signature, the checksums and the parser see those bytes."""
    import io

    entries = read_entries(signed.read_bytes())
    good = next(e.data for e in entries if e.name == schema.MANIFEST_PATH)
    evil = good.replace(b'"branchy"', b'"brunchy"')  # as long as the original, a widened guard alike
    assert evil != good and len(evil) == len(good)
    opened: list[str] = []
    original_open = zipfile.ZipFile.open

    def swapping_open(self, name, *args, **kwargs):
        name = getattr(name, "filename", name)
        opened.append(name)
        if name == schema.MANIFEST_PATH and opened.count(name) > 1:
            return io.BytesIO(evil)  # the second read sees the attacker's version
        return original_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", swapping_open)
    runner = load(signed, trust=_trust(keys, "ours"))
    runner.bundle.close()
    assert runner.manifest.name == "branchy"
    assert opened.count(schema.MANIFEST_PATH) == 1
    assert len(opened) == len(set(opened))  # no member reopened after its check


def test_bad_trust_files_and_a_missing_library_are_environment_errors(signed, keys, monkeypatch):
    with pytest.raises(EnvError, match=r"not an ed25519 or ECDSA \(P-256, P-384, P-521\) public key in PEM"):
        load(signed, trust=[str(keys / "ours")])  # the private key by mistake
    with pytest.raises(EnvError, match="cannot be read"):
        load(signed, trust=[str(keys / "missing.pub")])
    for name in [m for m in sys.modules if m.split(".")[0] == "cryptography"] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(EnvError, match=r"pip install 'aotpack\[sign\]'"):
        load(signed, trust=_trust(keys, "ours"))


def test_signing_is_deterministic_and_changes_no_other_member(built, keys, tmp_path):
    unsigned = built("branchy").read_bytes()
    path = tmp_path / "b.tpk"
    path.write_bytes(unsigned)
    sign_bundle(path, keys / "ours")
    first = path.read_bytes()
    sign_bundle(path, keys / "theirs")  # re-signing replaces the signature
    assert [e.name for e in read_entries(path.read_bytes())].count(schema.SIGNATURE_PATH) == 1
    sign_bundle(path, keys / "ours")
    assert path.read_bytes() == first
    signed_entries = {e.name: e.data for e in read_entries(first)}
    assert {e.name: e.data for e in read_entries(unsigned)} == {
        k: v for k, v in signed_entries.items() if k != schema.SIGNATURE_PATH
    }
    # without its signature member the archive is the packager's, byte for byte
    members = {
        k: v for k, v in signed_entries.items() if k not in (schema.MANIFEST_PATH, schema.SIGNATURE_PATH)
    }
    write_archive(tmp_path / "stripped.tpk", signed_entries[schema.MANIFEST_PATH], members)
    assert (tmp_path / "stripped.tpk").read_bytes() == unsigned


def test_split_weights_are_covered_by_the_signature(built, keys, tmp_path):
    path = tmp_path / "split.tpk"
    manifest = pack(built.compiled("branchy"), path, split_weights=True)
    sign_bundle(path, keys / "ours")
    out, reference = _outputs(load(path, trust=_trust(keys, "ours")))
    assert torch.equal(out, reference[0])
    weights = path.with_name(manifest.external_weights)
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(BundleError, match="checksum mismatch in 'weights.safetensors'"):
        load(path, trust=_trust(keys, "ours"))


def test_sign_refuses_a_bundle_that_does_not_verify(built, keys, tmp_path):
    entries = read_entries(built("branchy").read_bytes())
    path = tmp_path / "corrupt.tpk"
    path.write_bytes(write_entries(with_member(entries, schema.GUARDS_PATH, b"changed\n", resign=False)))
    with pytest.raises(BundleError, match="checksum mismatch in 'guards.txt'"):
        sign_bundle(path, keys / "ours")


def test_a_failed_write_leaves_the_bundle_as_it_was(built, keys, tmp_path, monkeypatch):
    path = tmp_path / "b.tpk"
    path.write_bytes(built("branchy").read_bytes())

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(EnvError, match=f"cannot write the signed bundle to {path}: No space left on device"):
        sign_bundle(path, keys / "ours")
    assert path.read_bytes() == built("branchy").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tpk"]  # no partial file left


def test_inspect_says_whether_the_signature_matches(signed, keys, tmp_path, monkeypatch):
    from aot.cli.reports import bundle_summary, summary_text

    ours = fingerprint(read_public_key(keys / "ours.pub"))
    entries = read_entries(signed.read_bytes())
    m = copy.deepcopy(manifest_of(entries))
    m["name"] = "renamed"
    changed = tmp_path / "changed.tpk"
    changed.write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(m))))
    for path, matches, text in (
        (signed, True, "matches the manifest"),
        (changed, False, "DOES NOT match the manifest: changed after signing"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manifest, info = bundle_summary(str(path))
        assert [str(w.message) for w in caught if w.category is BundleWarning] == (
            []
            if matches
            else [
                f"{changed}: its signature by {ours} does not match its manifest: the bundle was changed "
                f"after signing; loading it anyway (no trust list set: --trust / AOTPACK_TRUST)"
            ]
        )
        assert info["signature"] == {"key": ours, "matches_manifest": matches}
        assert f"signature: signed by {ours} ({text})" in summary_text(manifest, info).splitlines()
    for name in [m for m in sys.modules if m.split(".")[0] == "cryptography"] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert bundle_summary(str(signed))[1]["signature"] == {"key": ours, "matches_manifest": None}


def test_the_loader_imports_cryptography_only_for_trust(built):
    code = (
        "import sys, aot.loader; r = aot.loader.load(sys.argv[1]); r(**r.example_inputs()); "
        "assert not any(m.startswith('cryptography') for m in sys.modules), 'cryptography imported'"
    )
    r = subprocess.run([sys.executable, "-c", code, str(built("branchy"))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_cli_keygen_sign_inspect_load(built, tmp_path, monkeypatch):
    key, bundle = tmp_path / "k", tmp_path / "b.tpk"
    bundle.write_bytes(built("branchy").read_bytes())
    r = aotpack("keygen", "-o", str(key))
    assert r.returncode == 0, r.stderr
    fp = fingerprint(read_public_key(f"{key}.pub"))
    assert (
        r.stderr.splitlines()[0] == f"wrote {key} (private: keep it secret) and {key}.pub (public), key {fp}"
    )
    r = aotpack("keygen", "-o", str(key))
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        1,
        f"error: {key} exists; keygen never overwrites a key, choose another path or remove it",
    )

    r = aotpack("load", str(bundle), "--trust", f"{key}.pub")
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        1,
        f"error: {bundle}: the bundle is not signed, and this loader trusts only bundles signed by {fp}; "
        f"sign it with `aotpack sign {bundle} --key KEY`",
    )
    r = aotpack("inspect", str(bundle))
    assert "signature: none (aotpack sign BUNDLE --key KEY)" in r.stdout.splitlines()

    r = aotpack("sign", str(bundle), "--key", str(key))
    assert (r.returncode, r.stderr.splitlines()[0]) == (0, f"signed {bundle} with key {fp}")
    r = aotpack("inspect", str(bundle))
    assert f"signature: signed by {fp} (matches the manifest)" in r.stdout.splitlines()
    r = aotpack("load", str(bundle), "--trust", f"{key}.pub", "--runs", "1")
    assert r.returncode == 0 and "max abs error vs build reference 0" in r.stdout, r.stderr

    other = tmp_path / "other"
    write_key_pair(other)
    monkeypatch.setenv("AOTPACK_TRUST", f"{other}.pub")
    r = aotpack("load", str(bundle))
    other_fp = fingerprint(read_public_key(f"{other}.pub"))
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        1,
        f"error: {bundle}: signed by {fp}, which is not a trusted key ({other_fp}); trust its public key "
        f"(--trust / AOTPACK_TRUST) or re-sign the bundle with a trusted key",
    )


def test_the_loader_modules_import_each_other_without_a_cycle():
    """The trust check reads bytes the bundle module hands it, so neither imports the other back
    (they once did: signature read the bundle's limits, bundle called signature)."""
    import ast
    from pathlib import Path

    folder = Path(aot.loader.bundle.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):  # module level and inside functions
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        imports[path.stem] = {n.split(".")[2] for n in names if n.startswith("aot.loader.")} - {path.stem}

    def cycle_from(start: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(imports.get(seen[-1], ())):
            if nxt == start:
                return (*seen, nxt)
            if nxt not in seen and (found := cycle_from(start, (*seen, nxt))):
                return found
        return None

    cycles = [c for m in sorted(imports) if (c := cycle_from(m, (m,)))]
    assert not cycles, " -> ".join(cycles[0])
