"""The CUDA-graph bucket combinations of a program with a relation among its symbols (a program
traced for ``height == width``): only those its relation admits are captured, and a call padded
onto one it does not admit runs without a graph. Checked on the key logic alone (no GPU)."""

from __future__ import annotations

from aot.loader.gpu import GraphRunner
from aot.schema import Bucket
from aot.symexpr import compile_expr


def _keys_of(relations: tuple[str, ...], paddable: bool = False) -> GraphRunner:
    runner = GraphRunner.__new__(GraphRunner)  # the key logic needs no GPU program
    runner.symbols = ["height", "width"]
    runner.buckets = {s: Bucket(symbol=s, sizes=(16, 19), paddable=paddable) for s in runner.symbols}
    runner.state = None
    runner._relations = [compile_expr(r) for r in relations]
    return runner


def test_only_the_combinations_a_relation_admits_are_captured():
    assert _keys_of(("height == width",)).all_keys() == [(19, 19), (16, 16)]
    assert _keys_of(()).all_keys() == [(19, 19), (19, 16), (16, 19), (16, 16)]


def test_a_call_padded_onto_a_combination_the_relation_refuses_runs_without_a_graph():
    square = _keys_of(("height == width",), paddable=True)
    assert square.bucket_for({"height": 17, "width": 17}) == (19, 19)
    assert square.bucket_for({"height": 16, "width": 16}) == (16, 16)
    refusing = _keys_of(("height*width <= 300",), paddable=True)
    assert refusing.bucket_for({"height": 17, "width": 15}) is None  # padded to 19x16 = 304
    assert refusing.bucket_for({"height": 16, "width": 16}) == (16, 16)
