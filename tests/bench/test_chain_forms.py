"""The kernels of ``bench/tma_gemv.py`` (GEMVs whose weights stream through TMA, from host-side
tensor descriptors), ``bench/attention_chain.py`` (decode attention forms, alone, in the q/k/v
GEMV's tail, and with the o projection in one kernel), ``bench/fused_mlp.py`` (an MLP block's two
kernels, and one) and ``bench/swap_rows.py`` (few-row GEMMs with W's rows on the product's wide
side, whole and in K slices, float16 here) against torch in Triton's interpreter: each bench's
``--check``, every form it can run on the CPU reported ok (the tensor-core attention forms are
checked on the GPU: the interpreter's bfloat16 dot is not the GPU's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, ROOT


@pytest.mark.parametrize(
    "script,forms",
    [
        ("tma_gemv.py", 8),
        ("attention_chain.py", 4),
        ("fused_mlp.py", 6),
        ("swap_rows.py", 25),
        ("split_sweep.py", 15),
    ],
)
def test_bench_kernels_match_torch_in_the_interpreter(script, forms):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [line for line in done.stdout.splitlines() if line.rstrip().endswith(("ok", "WRONG"))]
    assert len(results) == forms and all(
        line.rstrip().endswith(": ok") or line.rstrip().endswith(" ok") for line in results
    ), done.stdout


def test_megakernel_packing_lays_each_blocks_chunks_in_the_order_it_reads_them():
    """``bench/megakernel_chain.pack``: block b's j-th chunk is the tile and K step its kernel
    takes j-th (GEMV by GEMV, its tiles b, b + P, ..., each tile's K steps in order), at rows
    [(b * maxj + j) * R, ...) of the packed array; shapes whose tiles do not divide evenly."""
    import torch

    from bench.megakernel_chain import pack

    torch.manual_seed(0)
    r, bk, p = 4, 8, 3
    weights = [torch.randn(n, k) for n, k in ((20, 16), (8, 32), (12, 8))]
    packed, maxj = pack(weights, p, r, bk)
    assert maxj == max(
        sum(len(range(b, w.shape[0] // r, p)) * (w.shape[1] // bk) for w in weights) for b in range(p)
    )
    for b in range(p):
        j = 0
        for w in weights:
            for t in range(b, w.shape[0] // r, p):
                for s in range(w.shape[1] // bk):
                    assert torch.equal(packed[b * maxj + j], w[t * r : (t + 1) * r, s * bk : (s + 1) * bk]), (
                        b,
                        j,
                    )
                    j += 1


def test_megakernel_compiles_for_sm90_with_its_tma_ring_and_barrier():
    """``bench/megakernel_chain.py --compile-only 90``: the Gluon kernels compile without a GPU, the
    one-role form and the warp-specialized form (a loading warp, consuming warps) each at its
    configuration measured fastest, and their PTX holds the TMA loads, mbarrier waits and the grid
    barrier's atomics (every configuration takes minutes here: run the script for those)."""
    script = str(ROOT / "bench" / "megakernel_chain.py")
    done = subprocess.run(
        [sys.executable, script, "--compile-only", "90", "--configs", "14", "--ws", "10"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(lines) == 2 and all(line.startswith("ok") for line in lines), done.stdout[-3000:]


def test_a_chain_row_holds_its_difference_and_time_or_the_error_that_stopped_it(monkeypatch, capsys):
    """``bench/common.chain_row``, which the chain benches share: a row gets its difference from
    the reference and its µs (with ``per_us``'s fields); a form that raises (a compile error, a
    grid barrier that gave up) gets the exception's first and last lines instead and is not timed;
    each row is printed as one JSON line."""
    import json

    import torch

    import bench.common as common
    from aot.verify import timing

    timed = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(
        timing, "graph_us", lambda run, device, copies, repeats: timed.append(repeats) or 12.5
    )
    ran = []
    row = common.chain_row({"form": "a"}, lambda: ran.append(1), 7, lambda: 0.25, lambda us: {"per": us * 2})
    assert row == {"form": "a", "max_rel_diff": 0.25, "us": 12.5, "per": 25.0} and ran == [1] and timed == [7]

    def fails():
        raise RuntimeError("at 30:12:\n    j = _stage(...)\nNameError: no such name")

    failed = common.chain_row({"form": "b"}, lambda: None, 7, fails)
    assert failed == {
        "form": "b",
        "error": "RuntimeError: at 30:12: ... NameError: no such name",
    } and timed == [7]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [row, failed]
