"""The weights' upload for the runtime without torch: from the bundle's file into one device allocation.

``upload`` places every weight a program or a tuned plan reads at a multiple of ``ALIGN`` bytes
of one allocation, checked against the program's spec (``aot.weights``: the safetensors header's
bounds and parse, the torch loader's), and streams the weights member into it chunk by chunk
(``aot.bundle.Bundle.weights_stream``): up to ``WEIGHT_THREADS`` threads each read a chunk through
a page-locked staging buffer of their own, copy each piece to its weights' places and hash it
where it sits while the copies run. No copy of the whole file is made in host memory, and each
chunk's sha256 is checked as it is read: a damaged bundle is refused before the runner exists.
``Upload`` runs it on a thread of its own (the runner loads the cubins meanwhile) and hands on
``DeviceWeights``: the allocation and each weight's offset in it.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from aot import schema
from aot.digests import HASH_THREADS, on_threads
from aot.errors import BundleError
from aot.program import step_reads
from aot.runtime import driver as drv
from aot.runtime.plan import ALIGN, Checked
from aot.weights import header_limit, parse_header, weights_size_limit

# Up to this many threads each read a chunk of the weights (``aot.digests``) into a page-locked
# staging buffer of its own, copy it to the device and hash it (reads, copies and hashing all let
# go of the GIL), in pieces of ``STAGING_BYTES``.
WEIGHT_THREADS = HASH_THREADS
STAGING_BYTES = 4 << 20


@dataclass(frozen=True)
class DeviceWeights:
    """Every weight the programs read, in one device allocation of ``nbytes`` at ``base`` (0 when
    there are none): ``offsets`` maps each weight's name to its byte offset there."""

    base: int
    nbytes: int
    offsets: dict[str, int]


class Upload:
    """``upload`` on a thread of its own, begun at once (the bundle's reads, the hashing and the
    driver's copies let go of the GIL); ``join`` waits for it, ``result`` hands on its weights or
    raises its error, ``seconds`` is how long it took."""

    def __init__(self, gpu: drv.Device, checked: Checked, plans: dict[str, dict]):
        self.seconds = 0.0
        self._weights: DeviceWeights | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(gpu, checked, plans), name="aotpack-rt-weights"
        )
        self._thread.start()

    def _run(self, gpu: drv.Device, checked: Checked, plans: dict[str, dict]) -> None:
        start = time.perf_counter()
        try:
            gpu.bind()
            self._weights = upload(gpu, checked, plans)
        except BaseException as e:  # noqa: BLE001 - raised again by ``result``, on the loading thread
            self._error = e
        self.seconds = time.perf_counter() - start

    def join(self) -> None:
        self._thread.join()

    def result(self) -> DeviceWeights:
        if self._error is not None:
            raise self._error
        assert self._weights is not None, "result() before join()"
        return self._weights


def upload(gpu: drv.Device, checked: Checked, plans: dict[str, dict]) -> DeviceWeights:
    """Every weight a program or a plan (``plans``: per program, bucket key -> steps) reads, in
    one device allocation at ``ALIGN``-byte offsets, streamed from the bundle's file chunk by
    chunk (``_stream``). Each chunk's sha256 is checked as it is read; a mismatch is a
    ``BundleError``."""
    bundle, programs = checked.bundle, [e.program for e in checked.entries]
    declared = {w.name: w.spec for p in programs for w in p.weights}
    tuned = [p for by_key in plans.values() for p in by_key.values()]
    read = {
        r for steps in [*(e.steps for e in checked.entries), *tuned] for s in steps for r in step_reads(s)
    }
    read |= {o for p in programs for o in p.outputs}
    where = f"{bundle.path}: {schema.WEIGHTS_PATH}"
    limit = weights_size_limit(declared, where)
    if checked.manifest.members[schema.WEIGHTS_PATH].size > limit:
        raise BundleError(f"{where} is larger than the {limit} bytes its weights take")
    with bundle.weights_stream() as stream:
        head = _read_head(stream, where, header_limit(len(declared)))
        try:
            entries = parse_header(head, where, header_limit(len(declared)))
            offsets, total = _place(bundle.path, declared, read, entries)
        except BundleError:
            stream.check_head(head.data)  # a damaged file is told so, before what its header got wrong
            raise
        base = gpu.alloc(total) if total else 0
        places = sorted(
            (entries[name][2], entries[name][3], base + offset) for name, offset in offsets.items()
        )
        _stream(gpu, stream, head.data, places)
        stream.finish()
    return DeviceWeights(base, total, offsets)


def _place(path: Any, declared: dict, read: set[str], entries: dict) -> tuple[dict[str, int], int]:
    """Each weight the programs read at its ``ALIGN``-byte offset of the one allocation, checked
    against the program's spec: the offsets by name, and the allocation's bytes."""
    offsets: dict[str, int] = {}
    total = 0
    for name, spec in declared.items():
        if name not in read:
            continue
        got = entries.get(name)
        if got is None:
            raise BundleError(f"{path}: weight {name!r} is missing from {schema.WEIGHTS_PATH}")
        dtype, shape, begin, end = got
        if dtype != spec.dtype or [str(s) for s in shape] != list(spec.shape):
            raise BundleError(
                f"{path}: weight {name!r} is {dtype} {shape}, the program expects "
                f"{spec.dtype} {list(spec.shape)}"
            )
        offsets[name] = total
        total += -(-(end - begin) // ALIGN) * ALIGN
    return offsets, total


def _stream(gpu: drv.Device, stream, head: bytes, places: list[tuple[int, int, int]]) -> None:
    """Read the weights member's chunks (``stream.spans``) on up to ``WEIGHT_THREADS`` threads
    (one where the stream reads only in order, or has one chunk), each through a page-locked
    staging buffer of its own of ``STAGING_BYTES``: a piece is read into it, each of its bytes in
    a ``(begin, end, device address)`` span of ``places`` (sorted, apart) is copied to its
    address, and the piece is hashed where it sits while the copies run; the buffer is filled
    again once they are done. ``head``: the member's first bytes, read and parsed already, hashed
    as they are rather than read again."""
    chunks = stream.spans
    threads = min(WEIGHT_THREADS if stream.positional else 1, len(chunks))
    size = min(STAGING_BYTES, max(stream.size - len(head), 1))
    ends = [end for _, end, _ in places]
    buffers: list[int] = []
    events: list[Any] = []

    def load_chunk(index: int, worker: int) -> None:
        gpu.bind()
        begin, end, _ = chunks[index]
        buffer, view, event = buffers[worker], views[worker], events[worker]
        digest = hashlib.sha256(head[begin:end])
        at = min(max(begin, len(head)), end)  # past the bytes of the head
        while at < end:
            gpu.wait(event, None)  # the buffer's last copies are done (at once if none)
            n = stream.read_at(at, view[: min(size, end - at)])
            if not n:
                break  # short: ``check`` refuses it
            for lo_place, hi_place, address in places[bisect.bisect_right(ends, at) :]:
                if lo_place >= at + n:
                    break
                lo, hi = max(lo_place, at), min(hi_place, at + n)
                gpu.to_device(address + lo - lo_place, buffer + lo - at, hi - lo)
            gpu.record(event)
            digest.update(view[:n])  # beside the copies: both only read the buffer
            at += n
        stream.check(index, digest, at)

    try:
        for _ in range(threads):
            buffers.append(gpu.host_alloc(size))
            events.append(gpu.event())
        views = [memoryview((ctypes.c_char * size).from_address(b)).cast("B") for b in buffers]
        on_threads(len(chunks), threads, load_chunk)
    finally:
        gpu.synchronize()  # no copy still reads a buffer freed below
        for b in buffers:
            gpu.free_host(b)
        for e in events:
            gpu.destroy_event(e)


class _Head:
    """A safetensors header as ``parse_header`` reads it: the first bytes of a member whose length
    is the whole member's (the data stays in the file until it is streamed)."""

    def __init__(self, data: bytes, size: int):
        self.data, self.size = data, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        return self.data[key]


def _read_head(stream, where: str, limit: int) -> _Head:
    """The weights member's safetensors header, read from ``stream`` (``aot.weights.parse_header``
    checks it; its bytes are hashed with the first chunk); a length over ``limit`` is refused
    before it is read."""
    prefix = bytearray(8)
    got = stream.read_at(0, memoryview(prefix))
    (n,) = struct.unpack("<Q", bytes(prefix))
    if got < 8 or n > limit or 8 + n > stream.size:
        return _Head(bytes(prefix[:got]), stream.size)  # parse_header says why
    header = bytearray(n)
    stream.read_at(8, memoryview(header))
    return _Head(bytes(prefix + header), stream.size)
