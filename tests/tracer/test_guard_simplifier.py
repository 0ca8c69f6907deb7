"""The guard simplifier (``aot.tracer.guards``) on hand-written guards: how the guards torch.export
discovers become per-symbol admissible sets (range, modulus and residues, exclusions) and residual
relations, with the exact sets and texts expected. No tracing: each case takes milliseconds."""

from __future__ import annotations

import pytest

from aot.errors import TraceError
from aot.schema import GuardSource, Relation, SymbolGuard
from aot.tracer.guards import MAX_MODULUS, MAX_RANGE, GuardSimplifier, RawGuard


def guard(text: str, *symbols: str, line: int = 1) -> RawGuard:
    return RawGuard(text=text, symbols=tuple(sorted(symbols)), file="m.py", line=line, code=f"line {line}")


def source(text: str, line: int = 1) -> GuardSource:
    return GuardSource(text=text, file="m.py", line=line, code=f"line {line}")


def simplify(declared: dict[str, tuple[int, int]], *guards: RawGuard):
    s = GuardSimplifier(declared)
    s.add(list(guards))
    return {g.name: g for g in s.symbol_guards()}, s.relation_guards()


def admissible(g: SymbolGuard) -> tuple:
    return g.min, g.max, g.modulus, g.residues, g.excluded


def test_no_guard_keeps_the_declared_range():
    symbols, relations = simplify({"batch": (1, 16), "seq": (1, 256)})
    assert list(symbols) == ["batch", "seq"]  # declaration order
    assert symbols["seq"] == SymbolGuard("seq", 1, 256, 1, 256)
    assert relations == ()


@pytest.mark.parametrize(
    "text, expected, simplified",
    [
        ("seq >= 9", (9, 256, 1, (0,), ()), "seq >= 9"),
        ("seq > 8", (9, 256, 1, (0,), ()), "seq >= 9"),
        ("seq <= 100", (1, 100, 1, (0,), ()), "seq <= 100"),
        ("seq != 1", (2, 256, 1, (0,), ()), "seq >= 2"),  # an exclusion at the edge moves the edge
        ("(seq >= 4) and (seq < 10)", (4, 9, 1, (0,), ()), "seq >= 4 and seq <= 9"),
    ],
)
def test_a_range_guard_narrows_the_range(text, expected, simplified):
    symbols, relations = simplify({"seq": (1, 256)}, guard(text, "seq"))
    assert admissible(symbols["seq"]) == expected
    assert symbols["seq"].sources == (source(simplified),)
    assert (symbols["seq"].declared_min, symbols["seq"].declared_max) == (1, 256)
    assert relations == ()


@pytest.mark.parametrize(
    "text, expected, simplified",
    [
        ("seq % 2 == 0", (2, 64, 2, (0,), ()), "seq % 2 == 0"),
        ("seq % 2 == 1", (1, 63, 2, (1,), ()), "seq % 2 == 1"),
        ("seq % 3 != 0", (1, 64, 3, (1, 2), ()), "(seq % 3 == 1 or seq % 3 == 2)"),
        ("(seq % 4 == 1) or (seq % 4 == 2)", (1, 62, 4, (1, 2), ()), "(seq % 4 == 1 or seq % 4 == 2)"),
        ("seq // 8 * 8 == seq", (8, 64, 8, (0,), ()), "seq % 8 == 0"),
        ("seq % 64 == 0", (64, 64, 1, (0,), ()), "seq >= 64"),  # one value left: a range says it
    ],
)
def test_a_divisibility_guard_becomes_a_modulus_and_residues(text, expected, simplified):
    symbols, _ = simplify({"seq": (1, 64)}, guard(text, "seq"))
    assert admissible(symbols["seq"]) == expected
    assert symbols["seq"].sources == (source(simplified),)


def test_a_modulus_above_the_largest_is_described_with_exclusions():
    # MAX_MODULUS is 64: seq % 128 == 0 over 1..256 reads as multiples of 64 from 128, less 192
    assert MAX_MODULUS == 64
    symbols, _ = simplify({"seq": (1, 256)}, guard("seq % 128 == 0", "seq"))
    assert admissible(symbols["seq"]) == (128, 256, 64, (0,), (192,))
    assert symbols["seq"].sources == (source("seq >= 128 and seq % 64 == 0 and seq != 192"),)


def test_guards_on_one_symbol_intersect_and_keep_each_source_sorted_by_line():
    symbols, _ = simplify(
        {"seq": (1, 256)},
        guard("seq % 2 == 0", "seq", line=17),
        guard("seq > 8", "seq", line=15),
        guard("seq % 2 == 0", "seq", line=17),  # the same guard found twice is listed once
    )
    assert admissible(symbols["seq"]) == (10, 256, 2, (0,), ())
    assert symbols["seq"].sources == (source("seq >= 9", 15), source("seq % 2 == 0", 17))


def test_a_guard_that_always_holds_leaves_no_source():
    symbols, relations = simplify({"seq": (1, 64)}, guard("seq >= 1", "seq"), guard("seq * 2 <= 128", "seq"))
    assert symbols["seq"] == SymbolGuard("seq", 1, 64, 1, 64)
    assert relations == ()


@pytest.mark.xfail(
    strict=True,
    reason="describe_mask prefers a residue set that leaves the value out (seq % 58 in {0..6, 8..57} "
    "over 1..64) to an exclusion, so 'seq != 7' reads as a 57-residue modulus",
)
def test_an_inner_exclusion_is_listed_as_excluded():
    symbols, _ = simplify({"seq": (1, 64)}, guard("seq != 7", "seq"))
    assert admissible(symbols["seq"]) == (1, 64, 1, (0,), (7,))
    assert symbols["seq"].sources == (source("seq != 7"),)


def test_a_product_of_per_symbol_guards_splits_into_them():
    # reshape(B, T // 2, 2 * C) on [B, T, C] guards 16*T*B == 32*B*(T//2): just T % 2 == 0
    symbols, relations = simplify(
        {"batch": (1, 16), "seq": (1, 64)}, guard("16*seq*batch == 32*batch*(seq//2)", "batch", "seq")
    )
    assert admissible(symbols["seq"]) == (2, 64, 2, (0,), ())
    assert symbols["seq"].sources == (source("seq % 2 == 0"),)
    assert symbols["batch"] == SymbolGuard("batch", 1, 16, 1, 16)
    assert relations == ()


def test_a_multi_symbol_guard_narrows_each_symbol_it_constrains():
    symbols, relations = simplify(
        {"a": (1, 8), "b": (1, 8)}, guard("(a >= 3) and (b % 2 == 0)", "a", "b", line=4)
    )
    assert admissible(symbols["a"]) == (3, 8, 1, (0,), ())
    assert admissible(symbols["b"]) == (2, 8, 2, (0,), ())
    assert symbols["a"].sources == (source("a >= 3", 4),)
    assert symbols["b"].sources == (source("b % 2 == 0", 4),)
    assert relations == ()


def test_a_multi_symbol_guard_implied_by_single_symbol_ones_is_dropped():
    # with a >= 2 already known, a*b >= 2 always holds: nothing more to record
    symbols, relations = simplify(
        {"a": (1, 8), "b": (1, 8)}, guard("a*b >= 2", "a", "b"), guard("a >= 2", "a")
    )
    assert admissible(symbols["a"]) == (2, 8, 1, (0,), ())
    assert symbols["a"].sources == (source("a >= 2"),)
    assert symbols["b"] == SymbolGuard("b", 1, 8, 1, 8)
    assert relations == ()


def test_a_guard_that_couples_symbols_stays_a_relation():
    symbols, relations = simplify({"a": (1, 8), "b": (1, 8)}, guard("a == b", "a", "b", line=10))
    assert relations == (Relation(expr="a == b", source=source("a == b", 10)),)
    # a relation does not narrow either symbol on its own
    assert symbols["a"] == SymbolGuard("a", 1, 8, 1, 8)
    assert symbols["b"] == SymbolGuard("b", 1, 8, 1, 8)


def test_relations_are_sorted_and_listed_once_each():
    _, relations = simplify(
        {"a": (1, 8), "b": (1, 8), "c": (1, 8)},
        guard("b < c", "b", "c", line=3),
        guard("a == b", "a", "b", line=9),
        guard("a == b", "a", "b", line=2),  # the same relation from two lines: the first line is kept
    )
    assert relations == (
        Relation(expr="a == b", source=source("a == b", 2)),
        Relation(expr="b < c", source=source("b < c", 3)),
    )


def test_a_symbol_too_wide_to_enumerate_keeps_its_guards_as_relations():
    symbols, relations = simplify({"n": (1, MAX_RANGE + 1)}, guard("n >= 9", "n", line=5))
    assert symbols["n"] == SymbolGuard("n", 1, MAX_RANGE + 1, 1, MAX_RANGE + 1)
    assert relations == (Relation(expr="n >= 9", source=source("n >= 9", 5)),)


def test_a_guard_that_admits_nothing_names_its_line_and_what_to_do():
    with pytest.raises(TraceError) as e:
        simplify({"seq": (1, 64)}, guard("seq >= 100", "seq", line=12))
    assert str(e.value) == (
        "m.py:12: the guard seq >= 100 admits no value of seq in 1..64; widen the Dim or change this line: line 12"
    )


def test_a_multi_symbol_guard_that_admits_nothing_is_refused():
    with pytest.raises(TraceError) as e:
        simplify({"a": (1, 8), "b": (1, 8)}, guard("a + b > 20", "a", "b", line=7))
    assert str(e.value) == (
        "m.py:7: the guard a + b > 20 admits no value of a in 1..8; widen the Dim or change this line: line 7"
    )


@pytest.mark.parametrize(
    "guards",
    [
        (guard("seq >= 9", "seq", line=1), guard("seq <= 5", "seq", line=2)),
        (guard("seq % 2 == 0", "seq", line=1), guard("seq % 2 == 1", "seq", line=2)),
    ],
    ids=["ranges", "residues"],
)
def test_contradictory_guards_are_an_error_naming_the_symbol_and_range(guards):
    # each guard admits something alone; together nothing is left
    with pytest.raises(TraceError) as e:
        simplify({"seq": (1, 64)}, *guards)
    assert str(e.value) == "the guards on seq together admit no value in 1..64"
