"""A member's sha256 in chunks (``aot.digests``): what the packager records, the checks both
loaders run on several threads, and the refusals — a flipped byte in any chunk names that chunk
with the checksum text every other member gets; a member without chunk digests (schema 1.10 and
before) is checked whole, with the text it always had; malformed chunk lists are refused at open."""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import pytest

from aot import digests, schema
from aot.errors import BundleError

WHERE = Path("model.tpk")
NAME = "weights.safetensors"


def _member(data: bytes, chunk_bytes: int) -> schema.Member:
    size, chunks = digests.chunk_sha256(data, chunk_bytes)
    return schema.Member(
        sha256=hashlib.sha256(data).hexdigest(), size=len(data), chunk_bytes=size, chunk_sha256=chunks
    )


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(digests, "MIN_CHUNK_BYTES", 16)


def test_the_chunks_cover_the_member_in_order(small_chunks):
    data = random.Random(0).randbytes(1000)
    member = _member(data, 64)
    assert member.chunk_bytes == 64 and len(member.chunk_sha256) == 16  # 15 of 64, one of 40
    spans = digests.spans(member)
    assert [(b, e) for b, e, _ in spans] == [(i * 64, min(i * 64 + 64, 1000)) for i in range(16)]
    assert [d for _, _, d in spans] == [hashlib.sha256(data[b:e]).hexdigest() for b, e, _ in spans]
    digests.check_chunks(member, NAME, WHERE)
    for threads in (1, 3, 16):
        digests.check_member(data, member, NAME, WHERE, threads)


def test_a_member_of_one_chunk_keeps_its_one_sha256():
    data = b"x" * 100
    assert digests.chunk_sha256(data, 100) == (0, ())
    member = _member(data, 100)
    assert digests.spans(member) == [(0, 100, member.sha256)]


def test_a_flipped_byte_in_any_chunk_is_refused_naming_it(small_chunks):
    data = random.Random(1).randbytes(1000)
    member = _member(data, 64)
    for index, (begin, end, want) in enumerate(digests.spans(member)):
        bad = bytearray(data)
        bad[(begin + end) // 2] ^= 0x01
        with pytest.raises(BundleError) as e:
            digests.check_member(bytes(bad), member, NAME, WHERE, threads=4)
        assert str(e.value) == (
            f"model.tpk: checksum mismatch in 'weights.safetensors' (chunk {index + 1} of 16, bytes "
            f"{begin}..{end}, expected sha256 {want[:16]}…): the bundle is corrupt or truncated: "
            f"rebuild or re-copy it"
        )


def test_without_chunk_digests_the_whole_member_is_checked_with_the_old_text():
    data = random.Random(2).randbytes(1000)
    member = schema.Member(sha256=hashlib.sha256(data).hexdigest(), size=1000)
    digests.check_member(data, member, NAME, WHERE)
    bad = bytearray(data)
    bad[999] ^= 0x80
    with pytest.raises(BundleError) as e:
        digests.check_member(bytes(bad), member, NAME, WHERE)
    assert str(e.value) == (
        f"model.tpk: checksum mismatch in 'weights.safetensors' (expected sha256 {member.sha256[:16]}…): "
        f"the bundle is corrupt or truncated: rebuild or re-copy it"
    )


def test_bytes_of_another_length_are_refused(small_chunks):
    data = bytes(200)
    member = _member(data, 64)
    for other in (data[:-1], data + b"\0"):
        with pytest.raises(BundleError, match=r"checksum mismatch in 'weights.safetensors' \(chunk 1 of 4"):
            digests.check_member(other, member, NAME, WHERE)


@pytest.mark.parametrize(
    "chunk_bytes, count, what",
    [
        (64, 3, "lists 3 chunk digests of 64 bytes for 200 bytes"),  # 4 chunks
        (64, 5, "lists 5 chunk digests"),
        (8, 25, "lists 25 chunk digests of 8 bytes"),  # below MIN_CHUNK_BYTES
        (0, 1, "lists 1 chunk digests of 0 bytes"),
        (64, 0, "lists 0 chunk digests of 64 bytes"),
    ],
)
def test_malformed_chunk_lists_are_refused(small_chunks, chunk_bytes, count, what):
    member = schema.Member(
        sha256="0" * 64, size=200, chunk_bytes=chunk_bytes, chunk_sha256=("0" * 64,) * count
    )
    with pytest.raises(BundleError, match=what):
        digests.check_chunks(member, NAME, WHERE)


def test_a_malformed_chunk_sha256_is_refused(small_chunks):
    member = schema.Member(sha256="0" * 64, size=100, chunk_bytes=64, chunk_sha256=("0" * 64, "G" * 64))
    with pytest.raises(BundleError, match="has a malformed chunk sha256"):
        digests.check_chunks(member, NAME, WHERE)


def test_the_smallest_chunk_size_is_a_mebibyte():
    member = schema.Member(sha256="0" * 64, size=3 << 19, chunk_bytes=1 << 19, chunk_sha256=("0" * 64,) * 3)
    with pytest.raises(BundleError, match="at least 1048576 bytes"):
        digests.check_chunks(member, NAME, WHERE)


def test_on_threads_runs_every_index_once_and_raises_the_first_error():
    seen, workers, lock = [], set(), threading.Lock()

    def work(index, worker):
        with lock:
            seen.append(index)
            workers.add(worker)

    digests.on_threads(50, 4, work)
    assert sorted(seen) == list(range(50)) and workers <= {0, 1, 2, 3}

    begun = []

    def fail(index, worker):
        begun.append(index)
        if index == 0:
            raise BundleError("chunk 0 is bad")

    with pytest.raises(BundleError, match="chunk 0 is bad"):
        digests.on_threads(1000, 1, fail)
    assert begun == [0]  # one thread: nothing begun after the error
