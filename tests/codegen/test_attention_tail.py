"""The decode attention run at the end of the q/k/v GEMV (``aot.codegen.attention_tail``): a tiny
transformers Llama's and Phi-3's decode programs (float16, 2 layers, built for sm_90 with
``AOTPACK_ATTENTION_TAIL=on``: off by default, measured slower) launch 4 kernels a layer at one row, q/k/v's GEMV carrying the attention; in Triton's
interpreter the joined kernel matches its reference (the projection's and the attention's steps:
the rows, the attention's output and both caches) and leaves its counters zeroed, and a kernel
whose programs are not taken KV head by KV head (its attention run before its head's key and value
are stored) fails that check.

    pytest tests/codegen/test_attention_tail.py
"""

from __future__ import annotations

import pytest

from aot import schema
from tests.codegen.conftest import interpreted_one_row_decode
from tests.codegen.test_gemm_norm import _decode_build, _one_row_plan

ONE_ROW_LAYER = (  # a Llama layer's kernels at one row, in order
    "gemm_norm_mm_vec",  # q/k/v with the RMSNorm in its prologue, then the attention
    "gemm_mm_vec",  # o, the residual add in its epilogue
    "gemm_norm_halves_epilogue_vec",  # gate/up with the RMSNorm and the SiLU product
    "gemm_mm_vec",  # down
)


def _tail_build(kind: str, tmp_path_factory):
    from aot.codegen.attention_tail import ENV

    return _decode_build(kind, tmp_path_factory, {ENV: "on"})


@pytest.fixture(scope="module")
def llama_tail(tmp_path_factory):
    return _tail_build("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def llama_apart(tmp_path_factory):
    return _decode_build("llama", tmp_path_factory)  # the default: off


def _layers(names: list[str]) -> list[list[str]]:
    first = next(i for i, n in enumerate(names) if n.startswith("gemm_norm_mm_vec"))
    last = max(i for i, n in enumerate(names) if n.startswith("gemm_norm_halves")) + 2  # its down
    body = names[first:last]
    per = len(body) // 2
    return [body[:per], body[per:]]


@pytest.mark.slow  # a transformers Llama traced and built twice
def test_a_one_row_llama_layer_is_four_kernels(llama_tail, llama_apart):
    program, kernels, plan, names = _one_row_plan(llama_tail)
    for layer in _layers(names):
        assert len(layer) == len(ONE_ROW_LAYER), names
        assert all(n.startswith(p) for n, p in zip(layer, ONE_ROW_LAYER)), names
        assert layer[0].endswith("_attention"), layer
    assert not any(n.startswith("decode_attention") for n in names), names
    # the counters: one per (row, KV head) at the largest batch, kept between calls, zeroed
    counters = [n for n in program.scratch if n.endswith("_tail_arrivals")]
    assert len(counters) == 2
    assert all(program.buffers[n] == schema.TensorSpec("int32", ("4",)) for n in counters)  # 2 rows x 2
    tail = next(s for s in plan if s.kind == schema.StepKind.KERNEL and kernels[s.target].name == layer[0])
    kernel = kernels[tail.target]
    assert "tl.atomic_add(count_ptr + tail_pid, 1, sem='acq_rel', scope='gpu')" in kernel.source
    assert "cache_modifier='.cg'" in kernel.source  # the rows other programs stored, from L2
    assert tail.in_place and set(tail.in_place.values()) <= set(program.state)
    # without it (the default): the attention a kernel of its own, 5 a layer
    _, _, plan_apart, names_apart = _one_row_plan(llama_apart)
    assert len(names_apart) == len(names) + 2, (names_apart, names)
    assert sum(n.startswith("decode_attention_append_rope") for n in names_apart) == 2


# the programs' columns in grid order instead of KV head by KV head: the programs that count on
# KV head 0 then compute query columns alone, and its attention runs before its key and value
# columns are stored
UNORDERED = ("column_block = tl.where(", "column_block = tl.program_id(0) + 0 * tl.where(")


def _interpreted_tails(build, old: str = "", new: str = "") -> list:
    """The joined kernels' rows of ``interpreted_one_row_decode``: [name, output, ok, error]."""
    path, _, index = build
    _, rows = interpreted_one_row_decode(path, index, old, new)
    return [r[1:] for r in rows if r[1].endswith("_attention")]


@pytest.mark.slow  # the interpreter over a decode step's kernels
@pytest.mark.parametrize("kind", ["llama", "phi3"])  # phi3: its q/k/v one fused weight, as the model has it
def test_the_joined_kernel_matches_its_reference_in_the_interpreter(kind, llama_tail, tmp_path_factory):
    build = llama_tail if kind == "llama" else _tail_build(kind, tmp_path_factory)
    rows = _interpreted_tails(build)
    # per layer: the rows, the attention's output and both caches (the sum the first program
    # writes too), each within its tolerance; the counters left zeroed
    outputs = {r[1] for r in rows}
    assert len(rows) >= 2 * 4, rows
    assert any(o.startswith("scaled_dot_product_attention") for o in outputs), outputs
    assert sum(o.startswith("index_put") for o in outputs) == 4, outputs
    assert all(ok for _, _, ok, _ in rows), [r for r in rows if not r[2]]


@pytest.mark.slow  # the interpreter over a decode step's kernels
def test_programs_not_taken_head_by_head_fail_the_check(llama_tail):
    """The same kernel, its programs' columns in grid order (``UNORDERED``): the check fails."""
    rows = _interpreted_tails(llama_tail, *UNORDERED)
    assert rows and not all(ok for _, _, ok, _ in rows), rows
