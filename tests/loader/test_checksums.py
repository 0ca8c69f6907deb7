"""Checksums before use: a member whose bytes differ from the manifest's sha256 is refused before
anything parses it (or hands it to the CUDA driver).

The corruptions here keep the zip layer consistent (the CRC-32 in both headers matches the new
bytes), so only the manifest's sha256 can catch them. Parsers are replaced by spies that record
whether they ran.
"""

from __future__ import annotations

import zipfile
from dataclasses import replace

import pytest
import safetensors.torch
import zstandard

import aot.loader.weights
from aot import schema
from aot.errors import BundleError
from aot.loader import load
from aot.loader.bundle import open_bundle
from tests.hostile_util import crc_patched, read_entries, write_entries, zip_layout


def _corrupt(data: bytes) -> bytes:
    """Same length, one byte changed in the middle."""
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]


@pytest.fixture
def spies(monkeypatch):
    """Record calls of every parser a member can reach."""
    calls: list[str] = []

    def spy(name, original):
        def wrapper(*a, **k):
            calls.append(name)
            return original(*a, **k)

        return wrapper

    monkeypatch.setattr(zstandard, "frame_content_size", spy("zstd", zstandard.frame_content_size))
    monkeypatch.setattr(zstandard, "ZstdDecompressor", spy("zstd", zstandard.ZstdDecompressor))
    monkeypatch.setattr(
        aot.loader.weights, "parse_safetensors", spy("weights", aot.loader.weights.parse_safetensors)
    )
    monkeypatch.setattr(safetensors.torch, "load", spy("safetensors", safetensors.torch.load))
    return calls


def test_every_member_is_checked_before_it_is_parsed(tmp_path, built, spies):
    entries = read_entries(built("branchy").read_bytes())
    names = [e.name for e in entries if e.name != "manifest.json"]
    assert any(n.endswith(".cubin") for n in names) and any(n.endswith(".py") for n in names)
    parser = {
        "program.json.zst": "zstd",
        "weights.safetensors": "weights",
        "reference.safetensors": "safetensors",
    }
    for name in names:
        bad = [replace(e, data=_corrupt(e.data)) if e.name == name else e for e in entries]
        path = tmp_path / f"{name.replace('/', '_')}.tpk"
        path.write_bytes(write_entries(bad))  # zipfile writes a CRC that matches the corrupt bytes
        spies.clear()
        with pytest.raises(
            BundleError, match=rf"checksum mismatch in '{name}' \(expected sha256 [0-9a-f]{{16}}…\)"
        ):
            load(path)
        assert parser.get(name, "none") not in spies, f"{name} reached its parser: {spies}"
        if name != "weights.safetensors":  # the weights are checked when read, right after the program
            assert spies == [], f"{name}: something was parsed before the corrupt member was refused: {spies}"


def test_crc_consistent_corruption_in_place(tmp_path, built):
    """``crc_patched`` rewrites a stored member and its CRC in the original archive (no re-zip)."""
    original = built("branchy").read_bytes()
    for rec in zip_layout(original):
        if rec.method != zipfile.ZIP_STORED:
            continue
        data = original[rec.data_start : rec.data_start + rec.compress_size]
        path = tmp_path / "b.tpk"
        path.write_bytes(crc_patched(original, rec.name, _corrupt(data)))
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None  # the zip layer sees nothing wrong
        with pytest.raises(BundleError, match=f"checksum mismatch in '{rec.name}'"):
            load(path)


def test_members_are_used_as_checked_and_weights_rehashed_on_every_read(tmp_path, built, monkeypatch):
    """A member is read from the archive once, hashed and kept: bytes that changed after the bundle
    was opened and verified (disk corruption, a file rewritten in place) never reach
    ``cuModuleLoadData``. The weights, not kept, are hashed again on every read. The change is
    simulated at the one place the bytes come from."""
    import aot.loader.bundle as bundle_module

    bundle = open_bundle(built("branchy"))
    try:
        cubin = next(n for n in bundle.manifest.members if n.endswith(".cubin"))
        good = bundle.read(cubin)
        real = bundle_module.read_bounded
        monkeypatch.setattr(bundle_module, "read_bounded", lambda *a: _corrupt(real(*a)))
        assert bundle.read(cubin) == good
        with pytest.raises(BundleError, match=f"checksum mismatch in '{schema.WEIGHTS_PATH}'"):
            bundle.read(schema.WEIGHTS_PATH)
        monkeypatch.setattr(bundle_module, "read_bounded", real)
        assert bundle.read(schema.WEIGHTS_PATH)
    finally:
        bundle.close()


def test_chunked_weights_are_checked_on_several_threads_before_they_are_parsed(
    tmp_path, built, spies, monkeypatch
):
    """Weights with a sha256 per chunk (``aot.digests``; five chunks here, 16 MiB each as packed):
    the torch loader checks every chunk, on several threads, before parsing them; a byte flipped
    in any chunk is refused naming it, and nothing parses the weights."""
    from aot import digests
    from tests.hostile_util import with_chunk_digests

    monkeypatch.setattr(digests, "MIN_CHUNK_BYTES", 16)
    monkeypatch.setattr(digests, "HASH_THREADS", 3)
    entries = read_entries(built("branchy").read_bytes())
    weights = next(e.data for e in entries if e.name == schema.WEIGHTS_PATH)
    entries = with_chunk_digests(entries, -(-len(weights) // 5))
    good = tmp_path / "chunked.tpk"
    good.write_bytes(write_entries(entries))
    load(good)
    bundle = open_bundle(good)
    member = bundle.manifest.members[schema.WEIGHTS_PATH]
    bundle.check_weights()  # inspect's check, chunk by chunk in order
    bundle.close()
    assert len(member.chunk_sha256) == 5
    for index, (begin, end, want) in enumerate(digests.spans(member)):
        flipped = bytearray(weights)
        flipped[(begin + end) // 2] ^= 0x5A
        bad = tmp_path / f"bad{index}.tpk"
        bad.write_bytes(
            write_entries(
                [replace(e, data=bytes(flipped)) if e.name == schema.WEIGHTS_PATH else e for e in entries]
            )
        )
        spies.clear()
        text = (
            rf"checksum mismatch in '{schema.WEIGHTS_PATH}' \(chunk {index + 1} of 5, bytes {begin}\.\.{end}, "
            rf"expected sha256 {want[:16]}…\)"
        )
        with pytest.raises(BundleError, match=text):
            load(bad)
        assert "weights" not in spies
        bundle = open_bundle(bad)
        with pytest.raises(BundleError, match=text):
            bundle.check_weights()
        bundle.close()
