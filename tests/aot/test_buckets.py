"""Which buckets belong to a program, and the bundle-wide buckets of several (``aot.buckets``)."""

from __future__ import annotations

import pytest

from aot.buckets import bucket_sizes, check_buckets, contract_buckets, is_bucket, largest_first
from aot.errors import BundleError
from aot.schema import Bucket, Guards, Program, SymbolGuard, SymbolSource


def _program(*symbols: str) -> Program:
    sources = tuple(SymbolSource(symbol=s, input="x", dim=d) for d, s in enumerate(symbols))
    return Program(inputs=(), weights=(), buffers={}, steps=(), outputs=(), symbols=sources)


def test_bucket_sizes_follow_the_programs_symbols():
    buckets = (Bucket("seq", (1, 8)), Bucket("batch", (1, 4)))
    program = _program("batch", "seq")
    every = bucket_sizes(program, buckets)
    assert every == [
        {"batch": 1, "seq": 1},
        {"batch": 1, "seq": 8},
        {"batch": 4, "seq": 1},
        {"batch": 4, "seq": 8},
    ]
    assert sorted(every, key=largest_first)[0] == {"batch": 4, "seq": 8}
    assert bucket_sizes(_program("batch", "other"), buckets) == []  # a symbol without buckets
    assert is_bucket({"batch": 4, "seq": 8}, program, buckets)
    assert not is_bucket({"batch": 3, "seq": 8}, program, buckets)
    assert not is_bucket({"batch": 4}, program, buckets)


def test_the_contracts_buckets_are_paddable_only_where_every_program_checked_it():
    declared = (Bucket("batch", (1, 8, 64), paddable=True), Bucket("seq", (16, 128), paddable=True))
    general = (Bucket("batch", (2, 8, 64), True, "max abs diff 0 at batch=3->8"), Bucket("seq", (16, 128)))
    one = (Bucket("seq", (16, 128), False, "refused: padding seq 3 to 16 changed real rows by 0.5"),)
    merged = contract_buckets(declared, [("general", general), ("batch == 1", one)])
    assert merged == (
        Bucket("batch", (1, 8, 64), True, "max abs diff 0 at batch=3->8"),
        Bucket("seq", (16, 128), False, "refused: not checked (program general)"),
    )
    merged = contract_buckets(declared, [("batch == 1", one), ("general", general)])
    assert merged[1] == Bucket(
        "seq", (16, 128), False, "refused: padding seq 3 to 16 changed real rows by 0.5 (program batch == 1)"
    )
    undeclared = (Bucket("batch", (1, 8, 64)),)
    assert contract_buckets(undeclared, [("general", general)]) == undeclared


@pytest.mark.parametrize(
    "buckets, why",
    [
        ((Bucket("batch", (1, 65)),), "buckets of 'batch' must be 1..1024 ascending sizes its guards admit"),
        ((Bucket("batch", (4, 2)),), "ascending"),
        ((Bucket("batch", ()),), "ascending"),
        ((Bucket("batch", (1,)), Bucket("batch", (2,))), "not a symbol of the guards or repeats"),
        ((Bucket("seq", (1,)),), "not a symbol of the guards or repeats"),
    ],
)
def test_bad_buckets_are_a_bundle_error(buckets, why):
    guards = Guards(inputs=(), symbols=(SymbolGuard("batch", 1, 64, 1, 64),), relations=())
    check_buckets((Bucket("batch", (1, 64)),), guards, "b.tpk")
    with pytest.raises(BundleError, match="^b.tpk: ") as e:
        check_buckets(buckets, guards, "b.tpk")
    assert why in str(e.value)
