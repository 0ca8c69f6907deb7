"""A member's sha256 in fixed-size chunks, checked on several threads.

One thread hashes ~0.8 GB/s, so the weights of a mid-sized model took a third of a second to check
on their own. The packager records the sha256 of every ``CHUNK_BYTES`` of a large member
(``schema.Member.chunk_sha256``, beside the whole member's ``sha256``), and the loaders check the
chunks on up to ``HASH_THREADS`` threads at once: hashlib lets go of the GIL while it hashes a large
buffer. A member without chunk digests (built before schema 1.11, or one chunk long) is one span
checked against its ``sha256``. Torch-free: the torch loader and ``aot.runtime`` both use it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from aot import schema
from aot.archive import CORRUPT
from aot.archive import mismatch as whole_mismatch
from aot.errors import BundleError

# The packager hashes a member larger than this in chunks of this many bytes.
CHUNK_BYTES = 16 << 20
# A manifest's chunk size below this is refused: a hostile one must not make millions of digests.
MIN_CHUNK_BYTES = 1 << 20
# Threads that hash at once: beyond 8 the file's read from the page cache is the limit.
HASH_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
_SHA256 = re.compile(r"[0-9a-f]{64}")


def chunk_sha256(data: bytes | memoryview, chunk_bytes: int | None = None) -> tuple[int, tuple[str, ...]]:
    """``(chunk_bytes, digests)`` of a member's bytes for its manifest entry, in chunks of
    ``chunk_bytes`` (default ``CHUNK_BYTES``): ``(0, ())`` where the member fits in one chunk
    (its ``sha256`` alone checks it)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if len(data) <= chunk_bytes:
        return 0, ()
    view = memoryview(data).cast("B")
    spans = [(b, min(b + chunk_bytes, len(view))) for b in range(0, len(view), chunk_bytes)]
    out = [""] * len(spans)

    def digest(index: int, worker: int) -> None:
        begin, end = spans[index]
        out[index] = hashlib.sha256(view[begin:end]).hexdigest()

    on_threads(len(spans), HASH_THREADS, digest)
    return chunk_bytes, tuple(out)


def spans(member: schema.Member) -> list[tuple[int, int, str]]:
    """``(begin, end, sha256)`` of each chunk of the member, in order; one span over the whole
    member where it has no chunk digests (``check_chunks`` validated them at open)."""
    if not member.chunk_sha256:
        return [(0, member.size, member.sha256)]
    step = member.chunk_bytes
    return [(i * step, min((i + 1) * step, member.size), d) for i, d in enumerate(member.chunk_sha256)]


def check_chunks(member: schema.Member, name: str, path: Path) -> None:
    """``BundleError`` unless the member's chunk digests, if any, are well formed: a chunk size of
    at least ``MIN_CHUNK_BYTES`` and one sha256 for each chunk of its size."""
    if not member.chunk_bytes and not member.chunk_sha256:
        return
    count = -(-member.size // member.chunk_bytes) if member.chunk_bytes >= MIN_CHUNK_BYTES else -1
    if count < 1 or len(member.chunk_sha256) != count:
        raise BundleError(
            f"{path}: member {name!r} lists {len(member.chunk_sha256)} chunk digests of "
            f"{member.chunk_bytes} bytes for {member.size} bytes (expected one per chunk of at least "
            f"{MIN_CHUNK_BYTES} bytes): the bundle is {CORRUPT}"
        )
    if not all(_SHA256.fullmatch(d) for d in member.chunk_sha256):
        raise BundleError(f"{path}: member {name!r} has a malformed chunk sha256")


def mismatch(path: Path, name: str, member: schema.Member, index: int = 0) -> BundleError:
    """The error for bytes whose sha256 is not the manifest's: the whole member's, or chunk
    ``index``'s where the member has chunk digests."""
    if not member.chunk_sha256:
        return whole_mismatch(path, name, member)
    begin, end, want = spans(member)[index]
    return BundleError(
        f"{path}: checksum mismatch in {name!r} (chunk {index + 1} of {len(member.chunk_sha256)}, "
        f"bytes {begin}..{end}, expected sha256 {want[:16]}…): the bundle is {CORRUPT}"
    )


def check_member(
    data: bytes | memoryview, member: schema.Member, name: str, path: Path, threads: int = HASH_THREADS
) -> None:
    """``BundleError`` unless ``data`` is the member as its manifest entry describes it: its size,
    and each chunk's sha256 (hashed on ``threads`` threads), or the whole member's."""
    view = memoryview(data).cast("B")
    if len(view) != member.size:
        raise mismatch(path, name, member, 0)
    chunks = spans(member)
    bad: list[int] = []

    def check(index: int, worker: int) -> None:
        begin, end, want = chunks[index]
        if hashlib.sha256(view[begin:end]).hexdigest() != want:
            bad.append(index)

    on_threads(len(chunks), threads, check)
    if bad:
        raise mismatch(path, name, member, min(bad))


def on_threads(count: int, threads: int, work: Callable[[int, int], None]) -> None:
    """``work(index, worker)`` for every index below ``count``, on ``min(threads, count)``
    threads (this one is worker 0), each taking the next index in order; once one fails no index
    is begun, and the first error is raised here after every thread stopped."""
    indices = iter(range(count))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        while True:
            with lock:
                index = None if errors else next(indices, None)
            if index is None:
                return
            try:
                work(index, worker)
            except BaseException as e:  # noqa: BLE001 - raised again by the caller's thread
                with lock:
                    errors.append(e)
                return

    others = [
        threading.Thread(target=run, args=(w,), name=f"aotpack-hash-{w}", daemon=True)
        for w in range(1, min(threads, count))
    ]
    for t in others:
        t.start()
    try:
        run(0)
    finally:
        for t in others:
            t.join()
    if errors:
        raise errors[0]
