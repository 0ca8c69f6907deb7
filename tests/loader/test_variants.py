"""Several-program bundles: each program is checked against the manifest as the first is (its
guards within the bundle's contract, its ops listed, its inputs its guards', its weights the
same as the others'). Each case is a re-signed bundle of tests/data/size_one.py (four programs)
that loaded before these checks."""

from __future__ import annotations

import copy
import json

import pytest

from aot.errors import BundleError
from aot.loader import load
from tests.hostile_util import (
    manifest_bytes,
    manifest_of,
    program_json,
    read_entries,
    with_manifest_text,
    with_program_text,
    write_entries,
)


@pytest.fixture(scope="module")
def size_one(built) -> list:
    return read_entries(built("size_one").read_bytes())


def _write(tmp_path, entries, program=None, manifest=None):
    if program is not None:
        entries = with_program_text(entries, json.dumps(program, sort_keys=True).encode())
    if manifest is not None:
        entries = with_manifest_text(entries, manifest_bytes(manifest))
    path = tmp_path / "case.tpk"
    path.write_bytes(write_entries(entries))
    return path


def test_the_example_bundle_has_variants_and_loads(size_one):
    m = manifest_of(size_one)
    assert len(m["programs"]) == 4 and len(program_json(size_one)["variants"]) == 3


def test_a_variant_admitting_more_than_the_contract_is_refused(tmp_path, size_one):
    m = copy.deepcopy(manifest_of(size_one))
    (seq,) = [s for s in m["programs"][1]["guards"]["symbols"] if s["name"] == "seq"]
    seq["max"] = seq["declared_max"] = 1000  # the bundle's contract: seq <= 16
    path = _write(tmp_path, size_one, manifest=m)
    with pytest.raises(
        BundleError,
        match=r"program 1 admits input 'x' dim 1 \(seq\) over 1 <= seq <= 1000, beyond the bundle's contract 1 <= seq <= 16",
    ):
        load(path)


def test_a_variant_calling_an_op_the_manifest_does_not_list_is_refused(tmp_path, size_one):
    prog = copy.deepcopy(program_json(size_one))
    variant = prog["variants"][0]
    step = next(s for s in variant["steps"] if s["kind"] == "aten" and s["target"] != "aten.abs.default")
    assert "aten.abs.default" not in manifest_of(size_one)["ops"]
    variant["steps"].append(
        {
            **step,
            "target": "aten.abs.default",
            "args": [{"buf": step["outputs"][0]}],
            "kwargs": {},
            "outputs": ["zz_abs"],
        }
    )
    variant["buffers"]["zz_abs"] = variant["buffers"][step["outputs"][0]]
    path = _write(tmp_path, size_one, program=prog)
    with pytest.raises(
        BundleError, match=r"program 1 calls 'aten.abs.default', which the manifest's ops do not list"
    ):
        load(path)


def test_a_variant_taking_other_inputs_than_its_guards_is_refused(tmp_path, size_one):
    prog = copy.deepcopy(program_json(size_one))
    prog["variants"][0]["inputs"][0]["spec"]["shape"] = ["1", "seq", "16"]
    path = _write(tmp_path, size_one, program=prog)
    with pytest.raises(
        BundleError,
        match=r"program 1 takes inputs \[\('x', 'float32', \('1', 'seq', '16'\)\)\], its guards declare \[\('x', 'float32', \('1', 'seq', '8'\)\)\]",
    ):
        load(path)


def test_a_variant_declaring_a_weight_in_another_shape_is_refused(tmp_path, size_one):
    prog = copy.deepcopy(program_json(size_one))
    w = next(w for w in prog["variants"][2]["weights"] if w["name"] == "proj.weight")
    w["spec"]["shape"] = ["4", "16"]
    path = _write(tmp_path, size_one, program=prog)
    with pytest.raises(
        BundleError,
        match=r"program 3 declares weight 'proj.weight' as float32 \['4', '16'\], another program as float32 \['8', '8'\]",
    ):
        load(path)


def test_the_contracts_relations_hold_whichever_program_runs(tmp_path, size_one):
    """A relation of the bundle's contract that no program's guards repeat: a call that breaks it
    ran on the program that admitted it."""
    import torch

    from aot.errors import GuardError

    m = copy.deepcopy(manifest_of(size_one))
    source = {"text": "batch <= seq", "file": "model.py", "line": 3, "code": "assert B <= T"}
    m["guards"]["relations"] = [{"expr": "batch <= seq", "source": source}]
    runner = load(_write(tmp_path, size_one, manifest=m))
    runner(torch.ones(2, 3, 8))
    with pytest.raises(
        GuardError, match=r"inputs violate batch <= seq with batch=3, seq=2 \(guard from model.py:3"
    ):
        runner(torch.ones(3, 2, 8))
