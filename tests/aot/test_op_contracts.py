"""Argument contracts (``aot/op_contracts.py``): every allowlisted op has one, and the fuzz drives
every allowlisted op with hostile arguments (``tests/aot/fuzz_ops_driver.py``, in a process of its
own under an address-space limit, with guard bytes around every tensor and the freed heap
poisoned): each case is refused cleanly or runs without reading memory it does not own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aot.allowed_ops import ALLOWED_OPS, STATE_WRITE_OPS
from aot.aten import resolve_op
from aot.errors import BundleError
from aot.op_contracts import CONTRACTS
from tests.conftest import ROOT


def test_every_allowlisted_op_has_a_contract_and_only_they():
    assert set(CONTRACTS) == set(ALLOWED_OPS), sorted(set(CONTRACTS) ^ set(ALLOWED_OPS))
    assert not set(CONTRACTS) & STATE_WRITE_OPS


def test_an_op_without_a_contract_is_refused(monkeypatch):
    monkeypatch.delitem(CONTRACTS, "aten.relu.default")
    with pytest.raises(BundleError, match="aten.relu.default, which bundles may not call"):
        resolve_op("aten.relu.default")


def test_every_check_names_arguments_of_its_op():
    import torch

    for name, contract in CONTRACTS.items():
        _, packet, overload = name.split(".")
        params = {a.name for a in getattr(getattr(torch.ops.aten, packet), overload)._schema.arguments}
        for check in contract.checks:
            assert set(check.args) <= params, (name, check.args, params)


@pytest.mark.parametrize(
    "op, size, problem",
    [
        ("aten.expand.default", [-1, -1, 4], None),  # expand keeps every -1 dim: x.expand(-1, -1, 4)
        ("aten.view.default", [-1, -1, 4], "expected at most one -1 (inferred size)"),
        ("aten.expand.default", [-2, 4], "expected sizes in -1.."),
    ],
)
def test_size_lists_take_minus_one_as_their_op_means_it(op, size, problem):
    (check,) = CONTRACTS[op].checks
    got = check.test(size)
    assert got == problem if problem is None else got.startswith(problem), got


@pytest.mark.parametrize(
    "query, key, mask, gqa, problem",
    [
        ((2, 4, 5, 8), (2, 4, 64, 8), None, False, None),
        # a multi-query model (Falcon): one KV head broadcast against the query heads, ATen's math path
        ((2, 4, 5, 8), (2, 1, 64, 8), (2, 1, 5, 64), False, None),
        ((1, 4, 5, 8), (2, 4, 64, 8), (2, 4, 5, 64), False, None),
        ((2, 4, 5, 8), (2, 2, 64, 8), None, True, None),
        ((2, 4, 5, 8), (2, 2, 64, 8), None, False, "expected query [2, 4, 5, 8] and key [2, 2, 64, 8] of"),
        ((2, 4, 5, 8), (2, 3, 64, 8), None, True, "expected query [2, 4, 5, 8]'s heads a multiple"),
        # an empty side broadcasts in ATen to a result of the other's size that nothing writes
        ((1, 4, 5, 8), (0, 4, 64, 8), None, False, "expected query [1, 4, 5, 8] and key [0, 4, 64, 8] of"),
        (
            (2, 4, 5, 8),
            (2, 1, 64, 8),
            (3, 1, 5, 64),
            False,
            "expected a mask that broadcasts to [2, 4, 5, 64]",
        ),
    ],
)
def test_attention_shapes_admit_alike_or_broadcast_heads(query, key, mask, gqa, problem):
    """SDPA's contract: leading dims alike, or broadcasting where neither side is empty; with
    ``enable_gqa``, query heads a multiple of key heads. What it admits runs and equals the
    call on explicitly expanded keys and values."""
    import torch

    (_, check) = CONTRACTS["aten.scaled_dot_product_attention.default"].checks
    q, k = torch.randn(query), torch.randn(key)
    m = torch.zeros(mask) if mask is not None else None
    got = check.test(q, k, k, m, gqa)
    assert got == problem if problem is None else got.startswith(problem), got
    if problem is None and not gqa:
        lead = torch.broadcast_shapes(query[:-2], key[:-2])
        want = torch.nn.functional.scaled_dot_product_attention(
            q.expand(*lead, *query[-2:]), k.expand(*lead, *key[-2:]), k.expand(*lead, *key[-2:]), attn_mask=m
        )
        torch.testing.assert_close(
            torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=m), want
        )


def fuzz(ops: list[str]) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", "tests.aot.fuzz_ops_driver", *ops],
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=ROOT,
    )
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    last = lines[-1] if lines else {}
    assert r.returncode == 0, (
        f"the fuzz process died (status {r.returncode}) at {last.get('op')} {last.get('case')!r}: {r.stderr[-1500:]}"
    )
    return [line for line in lines if "outcome" in line]


@pytest.mark.slow
def test_hostile_arguments_to_every_allowlisted_op_are_refused_or_safe():
    """About 4,400 cases over every allowlisted op (a few minutes of one CPU core). Before the
    contracts, batch norm's short per-channel tensors, grid_sampler's modes out of 0..2 and
    attention's short value read memory they do not own here."""
    outcomes = fuzz(sorted(ALLOWED_OPS))
    assert {o["op"] for o in outcomes} == set(ALLOWED_OPS)
    invalid = [o for o in outcomes if o["case"] == "valid" and o["outcome"] != "ran"]
    assert not invalid, invalid[:5]  # each op's valid call runs: the hostile ones vary a real call
    leaks = [o for o in outcomes if o["outcome"] == "leak"]
    assert not leaks, leaks[:5]


@pytest.mark.slow
def test_the_fuzz_catches_an_op_that_trusts_its_arguments():
    """The canaries work: with the contracts of batch norm and grid_sampler emptied, their
    hostile cases read memory they do not own."""
    script = (
        "import sys, runpy\n"
        "import aot.op_contracts as c\n"
        "for op in sys.argv[1:]:\n"
        "    c.CONTRACTS[op] = c.Contract()\n"
        "runpy.run_module('tests.aot.fuzz_ops_driver', run_name='__main__')\n"
    )
    ops = ["aten._native_batch_norm_legit_no_training.default", "aten.grid_sampler_2d.default"]
    r = subprocess.run(
        [sys.executable, "-c", script, *ops], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    leaks = {json.loads(line)["op"] for line in r.stdout.splitlines() if '"leak"' in line}
    assert leaks == set(ops), r.stderr[-1000:]
