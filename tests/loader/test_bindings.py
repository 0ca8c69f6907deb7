"""The rules by which a captured graph's kernels may be pointed at a call's own tensors
(``aot.loader.bindings``), on recorded launches written by hand: no GPU needed. The GPU test
(``tests/gpu/test_gpu_runtime.py::test_bound_calls_equal_copied_calls``) runs them on real graphs."""

from __future__ import annotations

import pytest
import torch

from aot.loader.bindings import (
    MAX_INPUT_NODES,
    Bindings,
    Launch,
    Recorder,
    Slot,
    fits,
    input_slots,
    output_slots,
)

X = (1000, 1064)  # a static input's bytes
OUT = (5000, 5128)  # an output's storage


def launch(values, writes=(), fresh=(), seq=0):
    return Launch(
        node=seq + 1,
        fn=None,
        grid=(1, 1, 1),
        values=list(values),
        writes=frozenset(writes),
        fresh=frozenset(fresh),
        seq=seq,
    )


def test_every_pointer_into_an_input_is_re_pointed_with_its_offset():
    launches = [
        launch(
            [("ptr", 1000), ("ptr", 3000), ("i32", 1000)], writes=(1,), seq=1
        ),  # reads x; an i32 equal to x's address is no pointer
        launch(
            [("ptr", 3000), ("ptr", 1032), ("ptr", 4000)], writes=(2,), seq=2
        ),  # reads a view of x at 32 bytes
    ]
    assert input_slots(launches, [], *X) == (Slot(0, 0, 0), Slot(1, 1, 32))


def test_an_input_a_library_call_touches_or_a_kernel_writes_is_copied():
    reads = [launch([("ptr", 1000), ("ptr", 3000)], writes=(1,), seq=1)]
    assert input_slots(reads, [(2, 900, 1010)], *X) is None  # a cuBLAS call or a layout copy reads it
    assert input_slots(reads, [(2, 1064, 2000)], *X) == (Slot(0, 0, 0),)  # memory just past it: no overlap
    writes = [launch([("ptr", 1000)], writes=(0,), seq=1)]
    assert input_slots(writes, [], *X) is None


def test_an_output_binds_from_its_own_allocation_on():
    launches = [
        launch(
            [("ptr", 1000), ("ptr", 5000)], writes=(1,), fresh=(1,), seq=1
        ),  # a buffer that died, same memory
        launch([("ptr", 5000), ("ptr", 6000)], writes=(1,), fresh=(1,), seq=2),  # reads the dead buffer
        launch([("ptr", 6000), ("ptr", 5000)], writes=(1,), fresh=(1,), seq=3),  # the output's own allocation
        launch([("ptr", 5064), ("ptr", 7000)], writes=(1,), fresh=(1,), seq=4),  # reads half of it
    ]
    assert output_slots(launches, [], *OUT) == (Slot(2, 1, 0), Slot(3, 0, 64))
    assert output_slots(launches, [(2, 5000, 5128)], *OUT) == (
        Slot(2, 1, 0),
        Slot(3, 0, 64),
    )  # before it: another buffer
    assert output_slots(launches, [(5, 5000, 5128)], *OUT) is None  # a library call reads it after


def test_an_output_no_kernel_allocated_is_copied():
    written_in_place = [launch([("ptr", 1000), ("ptr", 5000)], writes=(1,), seq=1)]  # not allocated for it
    assert output_slots(written_in_place, [], *OUT) is None
    assert output_slots([], [], *OUT) is None


def test_a_call_binds_dense_aligned_tensors_of_the_static_shape_only():
    static = torch.zeros(4, 8, dtype=torch.float16)
    assert fits(static, torch.ones(4, 8, dtype=torch.float16))
    base = torch.ones(40, dtype=torch.float16)
    assert not fits(static, base[1:33].view(4, 8))  # 2 bytes off the 16-byte boundary
    assert not fits(static, torch.ones(8, 4, dtype=torch.float16).t())  # strided
    assert not fits(static, torch.ones(4, 8, dtype=torch.float32))
    assert not fits(static, torch.ones(2, 8, dtype=torch.float16))


@pytest.mark.parametrize("given", ["0", "1"])
def test_the_switch_reads_the_environment(given, monkeypatch):
    from aot.loader import bindings

    monkeypatch.setenv(bindings.DIRECT_BINDING_ENV, given)
    assert bindings.enabled() == (given == "1")


class _Graph:  # what ``Bindings.of`` asks of a captured graph: the driver takes a node's arguments
    def __init__(self):
        self.set = []

    def set_kernel_args(self, node, fn, grid, params):
        self.set.append(node)
        return True


def test_an_input_several_kernels_read_is_copied_and_one_kernel_reads_binds():
    """Re-pointing a node costs the host about what a small input's copy does: an input read by
    more than ``MAX_INPUT_NODES`` nodes is left to the copy; an output allocated by a kernel binds."""
    once, twice, result = torch.zeros(16), torch.zeros(16), torch.zeros(16)
    a, b, r = (t.untyped_storage().data_ptr() for t in (once, twice, result))
    recorder = Recorder(stream=0)
    recorder.launches = [
        launch([("ptr", a), ("ptr", b), ("ptr", 10)], writes=(2,), fresh=(2,), seq=1),
        launch([("ptr", b), ("ptr", 10), ("ptr", r)], writes=(2,), fresh=(2,), seq=2),
    ]
    graph = _Graph()
    binds = Bindings.of(recorder, graph, {"once": once, "twice": twice}, [result])
    assert MAX_INPUT_NODES == 1
    assert list(binds.inputs) == ["once"] and list(binds.outputs) == [0]
    assert graph.set == [2]  # the driver was asked once, with a node's own arguments, before any call
    given = torch.zeros(16)
    binds.point(graph, {("in", "once"): given})
    assert recorder.launches[0].values[0] == ("ptr", given.data_ptr()) and graph.set == [2, 2]
    binds.point(graph, {("in", "once"): given})  # the same tensor again: nothing to change
    assert graph.set == [2, 2]
    binds.point(graph, {})  # back to the static buffer
    assert recorder.launches[0].values[0] == ("ptr", a) and graph.set == [2, 2, 2]
