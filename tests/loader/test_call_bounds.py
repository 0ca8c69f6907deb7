"""Memory and arithmetic of a call, bounded before any of its steps runs (``aot/loader/prerun.py``):
a step that would make more than its declared buffer, and a call that would compute more than its
budget, are refused before the first step, through re-signed hostile programs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from aot.errors import EnvError
from aot.loader import load
from tests.conftest import ROOT
from tests.hostile_util import aten_step, program_json, read_entries, resigned_program
from tests.loader.test_hostile_programs import with_steps

CPU = {"device": "runtime"}
F32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def branchy(built) -> tuple[bytes, dict]:
    data = built("branchy").read_bytes()
    return data, program_json(read_entries(data))


GROWTH_DRIVER = r"""
import json, resource, sys
import torch
from aot.errors import AotError
from aot.loader import load

runner = load(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    runner(torch.ones(2, 16, 16))
    outcome = "accepted"
except AotError as e:
    outcome = type(e).__name__ + ": " + str(e)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps([outcome, grown * 1024]))
"""


def test_a_step_making_more_than_its_buffer_is_refused_before_it_allocates(tmp_path, branchy):
    """A 1 GiB ``full`` declared as 4 floats: the step allocated (and filled) 1 GiB on every call
    before its result was refused; now the call is refused before the first step runs."""
    base, prog = branchy
    size = {"sym": "max(16 - batch, 0) * 16777216"}  # nothing at batch 16 (the largest), 939 MB at 2
    step = aten_step("aten.full.default", [[size], 1.0], ["zz_big"], dtype=F32, device=CPU)
    p = with_steps(prog, [step], declare={"zz_big": {"dtype": "float32", "shape": ["4"]}})
    path = tmp_path / "big.tpk"
    path.write_bytes(resigned_program(base, p))
    r = subprocess.run(
        [sys.executable, "-c", GROWTH_DRIVER, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    outcome, grown = json.loads(r.stdout.splitlines()[-1])
    assert outcome == (
        "BundleError: step 0 aten.full.default would make 'zz_big' of 939524096 bytes at sizes batch=2, "
        "seq=16, its buffer declares 16; refused before it ran: the program is wrong, rebuild the bundle"
    )
    assert grown < 256 << 20, f"the process grew by {grown} bytes"


def _huge_product(prog: dict, rows: str) -> dict:
    """A [rows, 65536] by [65536, 4096] product of expanded one-element tensors: no memory (views),
    2·rows·65536·4096 operations (2.2e12 at rows=4096: minutes of CPU)."""
    one = aten_step("aten.full.default", [[1, 1], 1.0], ["zz_one"], dtype=F32, device=CPU)
    a = aten_step("aten.expand.default", [{"buf": "zz_one"}, [{"sym": rows}, 65536]], ["zz_a"])
    b = aten_step("aten.expand.default", [{"buf": "zz_one"}, [65536, 4096]], ["zz_b"])
    mm = aten_step("aten.mm.default", [{"buf": "zz_a"}, {"buf": "zz_b"}], ["zz_mm"])
    declare = {
        "zz_one": {"dtype": "float32", "shape": ["1", "1"]},
        "zz_a": {"dtype": "float32", "shape": [rows, "65536"]},
        "zz_b": {"dtype": "float32", "shape": ["65536", "4096"]},
        "zz_mm": {"dtype": "float32", "shape": [rows, "4096"]},
    }
    return with_steps(prog, [one, a, b, mm], declare=declare)


def test_a_call_computing_more_than_max_flops_is_refused_before_the_step_runs(tmp_path, branchy):
    """At batch 1 the product has 3841 rows: 2.1e12 operations, minutes of CPU (a 6 kB bundle's call
    ran for more than 30 s); with ``max_flops`` it is refused before the product runs, and calls
    within the budget still run."""
    base, prog = branchy
    path = tmp_path / "flops.tpk"
    path.write_bytes(resigned_program(base, _huge_product(prog, "max(4097 - 256*batch, 1)"), replan=True))
    runner = load(path, max_flops=10**10)
    runner(torch.ones(16, 16, 16))
    with pytest.raises(EnvError) as e:
        runner(torch.ones(1, 16, 16))
    assert str(e.value) == (
        "a call at sizes batch=1, seq=16 would compute more than 2.06e+12 operations (by step 3 aten.mm.default), "
        "more than max_flops 1e+10; refused before that step ran: call with smaller inputs, or load with a "
        "larger max_flops"
    )
    runner(torch.ones(16, 16, 16))
    with pytest.raises(ValueError, match="max_flops must be a positive number of operations, got 0"):
        load(path, max_flops=0)


def test_load_takes_max_flops_on_the_command_line(tmp_path, branchy, capsys):
    """``aotpack load --max-flops`` holds every call to the budget: one ``error:`` line, exit 1."""
    from aot.cli import main

    base, prog = branchy
    path = tmp_path / "flops.tpk"
    path.write_bytes(resigned_program(base, _huge_product(prog, "max(4097 - 256*batch, 1)"), replan=True))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["load", str(path), "--sizes", "batch=1,seq=16", "--max-flops", "1e10", "--iters", "1"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 1, err
    assert err[-1].startswith("error: a call at sizes batch=1, seq=16 would compute more than 2.06e+12"), err
