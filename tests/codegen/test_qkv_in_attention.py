"""The q/k/v projection's K slices summed in the decode attention kernel
(``aot.codegen.qkv_in_attention``): a Llama-shaped decoder layer (hidden 2048, 32 query heads
over 8 KV heads: q/k/v runs in 3 K slices at 2 rows), built with and without the fold."""

from __future__ import annotations

import json

import pytest

from tests.codegen.conftest import interpreted_json

ARCHS = ("sm_90",)


def _build(tmp_path_factory, on: bool):
    from tests.realmodels.conftest import unusable

    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    import transformers

    from aot.codegen import generate
    from aot.codegen.qkv_in_attention import ENV
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace

    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=64,
    )
    # float16: the interpreter computes bfloat16's tl.dot wrongly (test_decode_attention.py)
    spec = causal_lm(
        lambda: transformers.LlamaForCausalLM(cfg),
        max_batch=2,
        max_context=16,
        dtype="float16",
        name="llama_qkv",
        batch_buckets=(1, 2),
    )
    said: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "on" if on else "off")
        compiled = generate(trace(spec), ARCHS, progress=said.append)
    path = tmp_path_factory.mktemp("qkv_on" if on else "qkv_off") / "model.tpk"
    pack(compiled, path)
    return path, compiled, said


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    return _build(tmp_path_factory, True)


@pytest.fixture(scope="module")
def apart(tmp_path_factory):
    return _build(tmp_path_factory, False)


def _plan_names(compiled, rows: int) -> list[str]:
    from aot.schema import StepKind
    from aot.tuning import tuned_plans

    programs = [compiled.program, *compiled.program.variants]
    index = len(programs) - 1  # the decode program
    program = programs[index]
    kernels = {k.id: k.name for k in program.kernels}
    plan = tuned_plans(compiled.tuning, index, program, "sm_90")[(rows,)]
    return [kernels[s.target] for s in plan if s.kind == StepKind.KERNEL]


def test_the_attention_sums_the_projections_slices_and_the_reduce_goes(folded, apart):
    """At 2 rows the folded plan runs the partials, then the summing attention (no reduce); the
    one without runs partials, reduce, attention. At one row (no K slices) both run the same
    kernels: the GEMV, then the attention as it was. The build says what it did."""
    _, on, said = folded
    _, off, _ = apart
    two_on, two_off = _plan_names(on, 2), _plan_names(off, 2)
    qkv = [n for n in two_off if n.startswith("gemm_mm_fews_splitk3_")]
    assert qkv == ["gemm_mm_fews_splitk3_16x64x64_partial", "gemm_mm_fews_splitk3_16x64x64_reduce"]
    at = two_off.index(qkv[1])
    assert two_off[at + 1] == "decode_attention_append_rope_g4_d64"
    assert two_on == [*two_off[:at], "decode_attention_append_rope_g4_d64_sums3", *two_off[at + 2 :]]
    assert _plan_names(on, 1) == _plan_names(off, 1)
    assert any("K slices summed in their decode attention kernels" in line for line in said)
    (source,) = [k.source for k in on.program.variants[-1].kernels if k.name.endswith("_sums3")]
    assert source.count("tl.load(rows_ws_ptr + 2 * rows_slice") == 5  # q, k, v and the rotary partners


def _run_plan(path, rows: int) -> str:
    return f"""
import json
from dataclasses import replace

import torch
from safetensors.torch import load

from aot.bundle import open_bundle
from aot.buckets import buckets_by_program
from aot.schema import WEIGHTS_PATH
from aot.tuning import read_tuning, tuned_plans
from aot.verify.interpret import interpret_kernels

b = open_bundle({str(path)!r})
main = b.program()
programs = [main, *main.variants]
index = len(programs) - 1
table = read_tuning(b, programs, buckets_by_program(b.manifest))
weights = load(b.read(WEIGHTS_PATH))
program = programs[index]
fused = replace(program, steps=tuned_plans(table, index, program, "sm_90")[({rows},)])
g = torch.Generator().manual_seed(0)
inputs = {{
    "input_ids": torch.tensor([[7], [11]][:{rows}]),
    "position_ids": torch.tensor([[5], [3]][:{rows}]),
    "cache_position": torch.tensor([5]),
    "attention_mask": torch.stack([(torch.arange(16) <= 5), (torch.arange(16) >= 2) & (torch.arange(16) <= 5)])[:{rows}].to(torch.int64),
}}
for t in program.inputs:
    if t.name.startswith(("key_cache", "value_cache")):
        shape = [{rows}, *(int(d) for d in t.spec.shape[1:])]
        inputs[t.name] = (0.5 * torch.randn(shape, generator=g)).to(torch.float16)
ends = {{}}
results = interpret_kernels(fused, weights, inputs, {{"batch": {rows}}}, from_kernels=ends)
outs = {{n: ends[n].float().flatten().tolist() for n in [*program.outputs, *(n for n in ends if n.startswith(("key_cache", "value_cache")))] if n in ends}}
print(json.dumps({{"kernels": [[r.step, r.name, r.output, r.ok, r.max_abs_error] for r in results], "outs": outs}}))
"""


@pytest.mark.slow  # two decode steps of a 2048-wide layer in the interpreter
def test_the_summing_attention_matches_its_reference_and_the_reduce_then_attention_bit_for_bit(folded, apart):
    """In Triton's interpreter at 2 rows (a left-padded second row): every kernel of the folded
    plan matches its reference (the summing attention against the q/k/v projection's and the
    attention's steps: its output and both caches it writes), and the step's logits and caches,
    computed through the kernels end to end, equal the unfolded plan's bit for bit (the same
    sums in the same order, rounded once)."""
    on = interpreted_json(_run_plan(folded[0], 2))
    off = interpreted_json(_run_plan(apart[0], 2))
    summing = [r for r in on["kernels"] if r[1].endswith("_sums3")]
    assert {r[2] for r in summing} >= {"index_put", "index_put_1"} and len(summing) == 3, summing
    bad = [r for r in on["kernels"] if not r[3]]
    assert not bad, bad[:3]
    assert on["outs"].keys() == off["outs"].keys() and len(on["outs"]) >= 3
    for name, values in on["outs"].items():
        assert values == off["outs"][name], name
    assert json.dumps(on["outs"]) == json.dumps(off["outs"])
