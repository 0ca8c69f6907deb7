"""Eager attention at one query as ``scaled_dot_product_attention`` (``aot.codegen.attention.
eager_attention_as_sdpa``), so that a model without an SDPA call decodes with the decode attention
kernel: GPT-J's (float32 scores, ``bmm`` over ``expand``/``view``, divided by a constant, an
additive mask, softmax, cast back) becomes one SDPA step per layer of its decode program, with the
constant's reciprocal as ``scale``, and the decode kernel takes it; its prefill (queries of any
length) keeps its steps; CodeGen's, which adds the mask before scaling, is left alone. In the slow
run: the kernels also write the step's keys (GPT-J's, rotated, [B, 1, H, D] permuted heads first)
and values into the cache, each decode kernel of GPT-J's bundle matches its reference (the cache
writes included) in Triton's interpreter, and the bundle's greedy tokens equal transformers'
(``tests/lm/test_hf_generate.py``).
"""

from __future__ import annotations

import pytest

from aot.codegen.attention import SDPA, eager_attention_as_sdpa


def _decode_program(kind: str, dtype: str = "float16"):
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    traced = trace(causal_lm(factory(kind), max_batch=2, max_context=32, name=kind, dtype=dtype))
    return traced.programs[0].program, traced.programs[1].program


def test_gptj_decode_attention_becomes_sdpa():
    prefill, decode = _decode_program("gptj")
    rewritten, n = eager_attention_as_sdpa(decode)
    assert n == 2  # one per layer
    sdpa = [s for s in rewritten.steps if s.target == SDPA]
    assert len(sdpa) == 2 and not any(s.target == "aten.bmm.default" for s in rewritten.steps)
    assert not any(s.target == "aten._softmax.default" for s in rewritten.steps)
    for s in sdpa:
        q, k, v, mask = s.args[:4]
        assert rewritten.buffers[q.name].shape == ("batch", "4", "1", "8")  # the half-precision query
        assert rewritten.buffers[q.name].dtype == "float16"
        assert k.name.startswith("index_put") and v.name.startswith("index_put")  # the cache itself
        assert rewritten.buffers[mask.name].shape == ("batch", "1", "1", "32")
        assert s.kwargs["scale"] == pytest.approx(1 / 8**0.5)  # GPT-J divides by sqrt(head dim)
    assert eager_attention_as_sdpa(prefill)[1] == 0  # queries of any length: left as they are


def test_an_eager_attention_scaling_after_its_mask_is_left_alone():
    _, decode = _decode_program("codegen")  # (scores + mask) / scale: the mask would be scaled too
    assert eager_attention_as_sdpa(decode) == (decode, 0)


@pytest.mark.slow  # a build, then the decode program's kernels in the interpreter
def test_gptj_decodes_with_the_decode_kernel(tmp_path):
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.codegen.conftest import decode_kernel_checks
    from tests.hf.test_causal_lm import factory

    said: list[str] = []
    spec = causal_lm(factory("gptj"), max_batch=2, max_context=32, name="gptj", dtype="float32")
    compiled = generate(trace(spec), ("sm_90",), progress=said.append)
    taken = "2 one-token SDPA calls over a KV cache run as decode attention kernels, 2 of them writing"
    assert any(taken in m for m in said), said  # the new keys (after the rotary) and values too
    decode = compiled.program.variants[0]
    assert sum(k.config.get("kind") == "decode_attention" for k in decode.kernels) == 1  # both layers' kernel
    bundle = tmp_path / "gptj.tpk"
    pack(compiled, bundle)
    checks = decode_kernel_checks(bundle, position=20, padding=3)
    attention = [c for c in checks if c[0].startswith("decode_attention")]
    assert attention and all(ok for *_, ok in checks), [c for c in checks if not c[3]]
