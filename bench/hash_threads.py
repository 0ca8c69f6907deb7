"""How fast the weights' sha256 is checked on 1..N threads (``aot.digests``): a buffer of random
bytes in ``CHUNK_BYTES`` chunks, checked in memory (the torch loader's path) and read from a file
through ``Bundle.weights_stream``-style positional reads into one buffer per thread (the runtime's
path without its device copies), the median of ``--repeat`` runs each.

    python bench/hash_threads.py [--mib 256] [--threads 1,2,4,8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from aot import digests, schema


def _read_and_hash(path: Path, member: schema.Member, threads: int, piece: int) -> None:
    """Each chunk read with ``os.preadv`` into its thread's buffer, piece by piece, and hashed."""
    spans = digests.spans(member)
    buffers = [memoryview(bytearray(piece)) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    try:

        def chunk(index: int, worker: int) -> None:
            begin, end, want = spans[index]
            digest, at, view = hashlib.sha256(), begin, buffers[worker]
            while at < end:
                n = os.preadv(fd, [view[: min(piece, end - at)]], at)
                digest.update(view[:n])
                at += n
            assert digest.hexdigest() == want

        digests.on_threads(len(spans), threads, chunk)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--piece-mib", type=int, default=4, help="the runtime's STAGING_BYTES")
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    chunk_bytes, chunks = digests.chunk_sha256(data)
    member = schema.Member(
        sha256=hashlib.sha256(data).hexdigest(), size=len(data), chunk_bytes=chunk_bytes, chunk_sha256=chunks
    )
    print(
        f"{args.mib} MiB, {len(chunks)} chunks of {chunk_bytes >> 20} MiB, cpus {os.cpu_count()}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.bin"
        path.write_bytes(data)  # in the page cache from here on
        for threads in [int(t) for t in args.threads.split(",")]:
            memory, file, cpu = [], [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                digests.check_member(data, member, "weights", path, threads)
                memory.append(time.perf_counter() - start)
                start, used = time.perf_counter(), time.process_time()
                _read_and_hash(path, member, threads, args.piece_mib << 20)
                file.append(time.perf_counter() - start)
                cpu.append((time.process_time() - used) / file[-1])
            gbs = lambda s: len(data) / statistics.median(s) / 1e9  # noqa: E731
            print(
                f"threads {threads}: in memory {statistics.median(memory) * 1e3:.0f} ms ({gbs(memory):.2f} GB/s), "
                f"read from the file and hashed {statistics.median(file) * 1e3:.0f} ms ({gbs(file):.2f} GB/s, "
                f"cores busy {statistics.median(cpu):.2f})"
            )


if __name__ == "__main__":
    main()
