"""Eager attention at one query as ``scaled_dot_product_attention`` (``aot.codegen.attention.
eager_attention_as_sdpa``), so that a model without an SDPA call decodes with the decode attention
kernel: GPT-J's (float32 scores, ``bmm`` over ``expand``/``view``, divided by a constant, an
additive mask, softmax, cast back) becomes one SDPA step per layer of its decode program, with the
constant's reciprocal as ``scale``, and the decode kernel takes it; its prefill (queries of any
length) keeps its steps; CodeGen's, which adds the mask before scaling, passes SDPA the mask
scaled (one step for every layer). In the slow
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


def test_codegen_decode_attention_becomes_sdpa_over_its_mask_scaled_once():
    """CodeGen divides (scores + mask) by its scale: the mask is scaled too, so SDPA (which adds
    its mask after scaling) gets ``mask / c``, one ``mul`` step for both layers."""
    _, decode = _decode_program("codegen")
    rewritten, n = eager_attention_as_sdpa(decode)
    assert n == 2
    sdpa = [s for s in rewritten.steps if s.target == SDPA]
    assert len(sdpa) == 2 and not any(s.target == "aten._softmax.default" for s in rewritten.steps)
    masks = {s.args[3].name for s in sdpa}
    assert len(masks) == 1  # both layers read the one scaled mask
    (scaled,) = [s for s in rewritten.steps if s.outputs == tuple(masks)]
    assert scaled.target == "aten.mul.Tensor" and scaled.args[1] == pytest.approx(1 / 8**0.5)
    assert rewritten.buffers[scaled.args[0].name] == rewritten.buffers[scaled.outputs[0]]
    assert all(s.kwargs["scale"] == pytest.approx(1 / 8**0.5) for s in sdpa)
    steps = list(rewritten.steps)
    assert steps.index(scaled) < min(steps.index(s) for s in sdpa)


def _logits(program, weights, position: int, padding: int, seed: int = 0, extended_step=None):
    """``program``'s first output, its ATen steps run one by one on the CPU at batch 2 (row 1
    left-padded by ``padding``), this step's token at ``position``, the cache random
    (``extended_step(step, env)``: runs the SDPA steps with keywords no library call takes)."""
    import torch

    torch.manual_seed(seed)
    env, sizes = dict(weights), {"batch": 2}
    for i in program.inputs:
        shape = [2 if d == "batch" else int(d) for d in i.spec.shape]
        if i.name == "input_ids":
            env[i.name] = torch.randint(0, 64, shape)
        elif i.name == "position_ids":
            env[i.name] = torch.tensor([[position], [position - padding]])
        elif i.name == "cache_position":
            env[i.name] = torch.tensor([position])
        elif i.name == "attention_mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[:, position + 1 :] = 0
            mask[1:, :padding] = 0
            env[i.name] = mask
        else:  # the KV cache as earlier steps left it
            env[i.name] = torch.randn(shape, dtype=getattr(torch, i.spec.dtype))
    return _run(program, env, sizes, extended_step)


def _run(program, env: dict, sizes: dict, extended_step=None):
    """``program``'s first output, its ATen steps run one by one on the CPU over ``env``."""
    import torch

    from aot.aten import AtenCall
    from aot.codegen.attention import extended

    env = dict(env)
    for step in program.steps:
        if extended_step is not None and extended(step):
            extended_step(step, env)
            continue
        AtenCall(step, torch.device("cpu"), state_aliases=frozenset(program.state))(env, sizes)
    return env[program.outputs[0]]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_codegens_rewritten_decode_program_computes_what_its_steps_did(dtype):
    """The rewritten program against the one traced, their ATen steps run on the CPU with one
    row left-padded: the logits agree within the dtype's tolerance."""
    import torch

    from aot.dtypes import tolerance
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    traced = trace(causal_lm(factory("codegen"), max_batch=2, max_context=32, name="codegen", dtype=dtype))
    decode = traced.programs[1].program
    rewritten, n = eager_attention_as_sdpa(decode)
    assert n == 2
    weights = dict(traced.weights)
    want, got = (_logits(p, weights, position=20, padding=3) for p in (decode, rewritten))
    bound = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=bound.atol, rtol=bound.rtol)
    assert want.abs().max() > 10 * bound.atol  # logits, not zeros


class _MaskThenScale:
    """CodeGen's attention of one query over a cache, with a mask of any values (not only 0 and
    the dtype's minimum, for which scaling the mask or not gives the same weights)."""

    def __new__(cls, divide: bool):
        import torch

        class Attention(torch.nn.Module):
            def forward(self, q, k, v, mask):  # [B, 4, 1, 8], [B, 4, 16, 8] x2, [B, 1, 1, 16]
                scores = q.float() @ k.float().transpose(-1, -2) + mask.float()
                scores = scores / 2.5 if divide else scores * 0.4
                return scores.softmax(-1).to(v.dtype) @ v

        return Attention()


@pytest.mark.parametrize("divide", [True, False])
def test_a_mask_added_before_the_scale_is_scaled_as_the_model_scales_it(divide):
    import torch

    from aot.spec import Dim, Input, ModelSpec
    from aot.tracer import trace

    batch = Dim("batch", 1, 4)
    shapes = {
        "q": (batch, 4, 1, 8),
        "k": (batch, 4, 16, 8),
        "v": (batch, 4, 16, 8),
        "mask": (batch, 1, 1, 16),
    }
    spec = ModelSpec(module=_MaskThenScale(divide), inputs=[Input(n, s) for n, s in shapes.items()])
    program = trace(spec).program
    rewritten, n = eager_attention_as_sdpa(program)
    assert n == 1 and [s.target for s in rewritten.steps].count(SDPA) == 1
    (sdpa,) = [s for s in rewritten.steps if s.target == SDPA]
    assert sdpa.kwargs["scale"] == pytest.approx(0.4)
    torch.manual_seed(0)
    inputs = {n: torch.randn(3, *[d for d in s[1:]]) for n, s in shapes.items()}
    inputs["mask"] = inputs["mask"] * 4  # values the scale changes
    want = _MaskThenScale(divide)(**inputs)
    got = _run(rewritten, inputs, {"batch": 3})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unscaled = torch.nn.functional.scaled_dot_product_attention(*inputs.values(), scale=0.4)
    assert not torch.allclose(unscaled, want, atol=1e-3)  # the mask's scale matters here


@pytest.mark.slow  # a build, then the decode program's kernels in the interpreter
@pytest.mark.parametrize("kind", ["gptj", "codegen", "bloom", "mpt"])
def test_eager_attention_decodes_with_the_decode_kernel(tmp_path, kind):
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.codegen.conftest import decode_kernel_checks
    from tests.hf.test_causal_lm import factory

    said: list[str] = []
    spec = causal_lm(factory(kind), max_batch=2, max_context=32, name=kind, dtype="float32")
    compiled = generate(trace(spec), ("sm_90",), progress=said.append)
    # the kernels write the new keys (after the rotary) and values too: GPT-J's [B, 1, H, D]
    # permuted heads first, CodeGen's values heads 3 * D apart in its projection's rows
    taken = "2 one-token SDPA calls over a KV cache run as decode attention kernels, 2 of them writing"
    assert any(taken in m for m in said), said
    decode = compiled.program.variants[0]
    assert sum(k.config.get("kind") == "decode_attention" for k in decode.kernels) == 1  # both layers' kernel
    bundle = tmp_path / f"{kind}.tpk"
    pack(compiled, bundle)
    checks = decode_kernel_checks(bundle, position=20, padding=3)
    attention = [c for c in checks if c[0].startswith("decode_attention")]
    assert attention and all(ok for *_, ok in checks), [c for c in checks if not c[3]]


def _extended_rewrite(kind: str) -> tuple:
    """``kind``'s decode program rewritten with ``originals``, having checked that without them
    nothing changes and with them both layers' attention is an extended SDPA step: (the traced
    decode program, the rewritten one, its SDPA steps, the originals)."""
    from aot.codegen.attention import extended

    _, decode = _decode_program(kind)
    assert eager_attention_as_sdpa(decode)[1] == 0
    originals: dict = {}
    rewritten, n = eager_attention_as_sdpa(decode, originals=originals)
    assert n == 2
    sdpa = [s for s in rewritten.steps if s.target == SDPA]
    assert len(sdpa) == 2 and all(extended(s) for s in sdpa)
    return decode, rewritten, sdpa, originals


def test_gemma2s_capped_attention_becomes_sdpa_only_for_the_decode_kernel():
    """Gemma 2's eager attention of one query (scores scaled, capped as ``c * tanh(s / c)``, the
    mask added, softmax in float32 of the half-precision scores, cast back; at a symbolic batch
    ``matmul`` copies its expanded operands): with ``originals`` each layer's becomes an SDPA step
    carrying ``softcap`` (which only the decode attention kernel computes) and its own steps are
    kept by the step's output; without, nothing changes (no library SDPA caps its scores)."""
    from aot.codegen.attention import SOFTCAP

    decode, rewritten, sdpa, originals = _extended_rewrite("gemma2")
    assert not any(s.target == "aten._softmax.default" for s in rewritten.steps)
    tanh = [sum(s.target == "aten.tanh.default" for s in p.steps) for p in (decode, rewritten)]
    assert tanh[1] == tanh[0] - 2  # the caps' (the GELU's and the logits' cap stay)
    for s in sdpa:
        # Gemma 2 scales by query_pre_attn_scalar ** -0.5 (its default 256), not the head dim
        assert s.kwargs[SOFTCAP] == 0.5 and s.kwargs["scale"] == pytest.approx(256**-0.5)
        own = [t.target for t in originals[s.outputs[0]].steps]
        assert own.count("aten.bmm.default") == 2 and "aten.tanh.default" in own, own
        assert originals[s.outputs[0]].steps[-1].outputs == s.outputs  # ends at the output it stands for


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "bloom", "mpt"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_restored_attention_computes_what_the_traced_steps_did(kind, dtype):
    """``restore_eager_attention`` over the rewritten program (no kernel took the steps beyond
    SDPA: Gemma 2's capped scores, GPT-OSS's sinks, Bloom's and MPT's ALiBi biases; MPT's mask
    read negated back): none is left, and its ATen steps, run on the
    CPU with one row left-padded, give the traced program's logits exactly (the same steps, the
    same order)."""
    import torch

    from aot.codegen.attention import extended, restore_eager_attention
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    traced = trace(causal_lm(factory(kind), max_batch=2, max_context=32, name=kind, dtype=dtype))
    decode = traced.programs[1].program
    originals: dict = {}
    rewritten, n = eager_attention_as_sdpa(decode, originals=originals)
    said: list[str] = []
    restored = restore_eager_attention(rewritten, originals, said.append)
    assert n == 2 and not any(extended(s) for s in restored.steps)
    assert said == [
        "  2 attention calls beyond SDPA (capped scores, sinks, biases) kept their own steps "
        "(no decode attention kernel took them)"
    ]
    if kind == "mpt":  # its mask negated for SDPA, then back for its own steps
        negations = [s for s in restored.steps if s.target == "aten.bitwise_not.default"]
        assert len(negations) == 3 and len({s.args[0].name for s in negations}) == 2
    weights = dict(traced.weights)
    want, got = (_logits(p, weights, position=20, padding=3) for p in (decode, restored))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert want.abs().max() > 0.1


def test_gpt_osss_attention_sinks_become_sdpa_only_for_the_decode_kernel():
    """GPT-OSS's eager attention of one query: the masked scores joined to a learned logit per
    head (``cat([s, sinks]) - max``, softmax, the sink's column dropped): with ``originals`` each
    layer's becomes an SDPA step carrying the [H] weight as ``sinks``; without, nothing changes."""
    from aot.codegen.attention import SINKS

    decode, rewritten, sdpa, originals = _extended_rewrite("gpt_oss")
    assert {s.kwargs[SINKS].name for s in sdpa} == {f"model.model.layers.{i}.self_attn.sinks" for i in (0, 1)}
    for target in ("aten._softmax.default", "aten.cat.default", "aten.max.dim"):  # the router's stay
        count = [sum(s.target == target for s in p.steps) for p in (decode, rewritten)]
        assert count[1] == count[0] - 2, (target, count)
    for s in sdpa:
        own = [t.target for t in originals[s.outputs[0]].steps]
        assert "aten.max.dim" in own and "aten.slice.Tensor" in own, own


@pytest.mark.slow  # two builds of a transformers Gemma 2
def test_a_capped_attention_no_kernel_takes_keeps_its_own_steps(monkeypatch):
    """Where the decode attention kernel refuses Gemma 2's capped attention (here: a head dim over
    its limit), the built decode program runs the model's own steps (its ``tanh`` among them) and
    nothing capped is left anywhere; by default the kernel takes both layers'."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import decode_sites, generate
    from aot.codegen.attention import extended
    from aot.hf import causal_lm
    from aot.schema import StepKind
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    traced = trace(causal_lm(factory("gemma2"), max_batch=2, max_context=32, name="gemma2"))

    def decode_of(compiled):
        (decode,) = [
            p for p in (compiled.program, *compiled.program.variants) if p.inputs[0].spec.shape[1] == "1"
        ]
        return decode

    def capped_anywhere(program) -> bool:
        return any(extended(s) or any(extended(r) for r in s.reference) for s in program.steps)

    taken = decode_of(generate(traced, ("sm_90",)))
    names = {k.id: k.name for k in taken.kernels}
    assert sum(s.kind == StepKind.KERNEL and names[s.target].endswith("_capped") for s in taken.steps) == 2
    assert not capped_anywhere(taken)
    monkeypatch.setattr(decode_sites, "MAX_HEAD_DIM", 4)
    said: list[str] = []
    refused = decode_of(generate(traced, ("sm_90",), progress=said.append))
    assert not capped_anywhere(refused)
    # the caps' tanh steps back as library calls, one per layer (the GELU's is in a fused kernel)
    assert sum(s.target == "aten.tanh.default" for s in refused.steps) == 2
    assert any(
        "2 attention calls beyond SDPA (capped scores, sinks, biases) kept their own steps" in m for m in said
    ), said


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_alibi_attention_becomes_sdpa_with_a_bias_only_for_the_decode_kernel(kind):
    """Bloom's eager attention (``baddbmm(alibi, q, k)`` over [B * H, 1, C], cast to half precision,
    viewed [B, H, 1, C], the mask added, softmax in float32) and MPT's (``q k^T * c + alibi`` of
    [H, 1, C] float32 biases, ``masked_fill`` by a bool mask): with ``originals`` each layer's becomes
    an SDPA step carrying its bias as ``bias`` ([B or 1, H, 1, C]: Bloom's the half-precision biases
    its cast widens, MPT's its float32 ones), MPT's mask negated (SDPA attends where True) once for
    both layers; without, nothing changes."""
    from aot.codegen.attention import BIAS

    _, rewritten, sdpa, _ = _extended_rewrite(kind)
    biases = {s.kwargs[BIAS].name for s in sdpa}
    specs = [rewritten.buffers[b] for b in biases]
    if kind == "bloom":  # one bias for both layers, built once from the 2-D mask
        assert len(biases) == 1 and [(b.shape, b.dtype) for b in specs] == [
            (("batch", "4", "1", "32"), "float16")
        ]
        assert {rewritten.buffers[s.args[3].name].dtype for s in sdpa} == {"float16"}  # the additive mask
    else:  # each layer slices its own from the [H, 1, max_seq_len] row
        assert len(biases) == 2 and {(b.shape, b.dtype) for b in specs} == {
            (("1", "4", "1", "32"), "float32")
        }
        (mask,) = {s.args[3].name for s in sdpa}
        made = [s for s in rewritten.steps if mask in s.outputs]
        assert [s.target for s in made] == ["aten.bitwise_not.default"] and rewritten.buffers[
            mask
        ].dtype == "bool"


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_an_sdpa_step_with_a_bias_computes_what_the_models_steps_did(kind):
    """The rewritten program, each SDPA step with a ``bias`` computed as its meaning says (the
    library's SDPA over its mask plus the bias: a bool mask as 0 or -inf), against the traced
    program, one row left-padded: the same logits within 1e-5 (float32). The bias's slots are
    the model's: added the wrong way round or to the wrong head, the logits move."""
    import torch

    from aot.codegen.attention import BIAS, extended
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    traced = trace(causal_lm(factory(kind), max_batch=2, max_context=32, name=kind, dtype="float32"))
    decode = traced.programs[1].program
    rewritten, n = eager_attention_as_sdpa(decode, originals={})
    assert n == 2

    assert sum(extended(s) for s in rewritten.steps) == 2

    def run(flip_heads: bool) -> torch.Tensor:
        def sdpa(step, env):
            q, k, v, mask = (env[a.name] for a in step.args[:4])
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
            bias = env[step.kwargs[BIAS].name].float()
            bias = bias.flip(1) if flip_heads else bias
            env[step.outputs[0]] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask + bias, scale=step.kwargs["scale"]
            )

        return _logits(rewritten, dict(traced.weights), position=20, padding=3, extended_step=sdpa)

    want = _logits(decode, dict(traced.weights), position=20, padding=3)
    torch.testing.assert_close(run(flip_heads=False), want, atol=1e-5, rtol=0)
    assert not torch.allclose(run(flip_heads=True), want, atol=1e-3)
