"""The decode attention's side programs (``AOTPACK_ATTENTION_AHEAD``): while the one-kernel decode
attention runs, programs of its grid beside its own stream the first MiB of a later kernel's weight
into L2 (``decode_attention.ahead_weight``, ``decode_attention_render.Ahead``). Which weight they
take (the kernel after next's: a Llama layer's gate/up, found on the program, through the GEMM's
views of its weight), how many bytes and programs, that the attention's own programs compute what
they did (Triton's interpreter, where the side programs only end), and that the sm_90 code issues
the bulk prefetch after the wait for the kernel before."""

from __future__ import annotations

import re

import pytest

from aot.schema import Buf, StepKind

MIB = 1 << 20


def _built(monkeypatch, setting: str | None, **spec):
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.realmodels.conftest import require

    require("transformers")  # torchvision made importable where it is installed, else skipped
    from tests.hf.test_causal_lm import factory

    if setting is None:
        monkeypatch.delenv("AOTPACK_ATTENTION_AHEAD", raising=False)
    else:
        monkeypatch.setenv("AOTPACK_ATTENTION_AHEAD", setting)
    made = causal_lm(factory("llama"), max_batch=2, max_context=16, batch_buckets=(1, 2), **spec)
    return generate(trace(made), ("sm_90",))


def _attention_steps(compiled):
    """(program, step, kernel) of every decode attention kernel step."""
    out = []
    for p in (compiled.program, *compiled.program.variants):
        kernels = {k.id: k for k in p.kernels}
        for i, s in enumerate(p.steps):
            if s.kind == StepKind.KERNEL and kernels[s.target].config.get("kind") == "decode_attention":
                out.append((p, i, kernels[s.target]))
    return out


def _matmul_weights_after(program, at: int) -> list[str]:
    """The weights of the matmuls after step ``at``, in order, each read through its permute
    (how the traced program reads a linear layer's weight), found here without the codegen."""
    weights = {w.name for w in program.weights}
    permuted = {}
    found = []
    for s in program.steps[at + 1 :]:
        if s.target == "aten.permute.default" and isinstance(s.args[0], Buf) and s.args[0].name in weights:
            permuted[s.outputs[0]] = s.args[0].name
        elif s.target == "aten.mm.default":
            found += [permuted[a.name] for a in s.args if isinstance(a, Buf) and a.name in permuted]
    return found


@pytest.fixture(scope="module")
def unset():
    with pytest.MonkeyPatch.context() as mp:
        return _built(mp, None)


@pytest.fixture(scope="module")
def on():
    with pytest.MonkeyPatch.context() as mp:
        return _built(mp, "on")


def test_off_by_default(unset):
    steps = _attention_steps(unset)
    assert len(steps) == 2
    assert all(not k.name.endswith("_ahead") and "pf_ptr" not in k.source for _, _, k in steps)


def test_the_side_programs_stream_the_gate_and_up_weight_after_the_o_projection(unset, on):
    steps = _attention_steps(on)
    assert len(steps) == 2
    plain = {i: k for _, i, k in _attention_steps(unset)}
    for program, at, kernel in steps:
        assert kernel.name.endswith("_ahead")
        o, gate_up, *_ = _matmul_weights_after(program, at)
        assert "o_proj" in o and gate_up.endswith("stacked2"), (o, gate_up)  # gate and up stacked
        step = program.steps[at]
        assert step.args[-2] == Buf(gate_up) and [p.name for p in kernel.params][-2:] == ["pf_ptr", "B"]
        spec = next(w.spec for w in program.weights if w.name == gate_up)
        assert tuple(spec.shape) == ("128", "32") and spec.dtype == "float32"  # [2 x 64, 32]
        source = kernel.source
        consts = {k: int(v) for k, v in re.findall(r"^(PF_\w+) = tl\.constexpr\((\d+)\)", source, re.M)}
        assert consts["PF_BYTES"] == 128 * 32 * 4  # the whole weight: under 16 MiB
        threads = 32 * kernel.num_warps
        assert consts["PF_THREADS"] == threads
        programs = -(-consts["PF_BYTES"] // (threads * 512))  # 512 bytes a thread at least
        assert consts["PF_CHUNK"] % 128 == 0 and consts["PF_CHUNK"] * threads * programs >= consts["PF_BYTES"]
        # the grid: the attention's own programs (B * KV heads), then the side programs
        assert step.grid == (f"{programs} + 2*batch",), step.grid
        # past the side programs' branch, the attention's lines are the plain kernel's
        assert at in plain
        assert source.split("    return\n", 1)[1] == _body(plain[at].source)


def _body(source: str) -> str:
    """A kernel's lines after its signature's comment."""
    return re.split(r"^    # .*: .*\n", source, maxsplit=1, flags=re.M)[1]


def test_the_cap_and_the_setting(monkeypatch):
    from aot.codegen.decode_attention import AHEAD_MIB, ahead_weight
    from aot.errors import CodegenError
    from aot.schema import NamedTensor, Program, Step, StepKind, TensorSpec

    def mm(w: str, out: str) -> list[Step]:
        return [
            Step(StepKind.ATEN, "aten.permute.default", (Buf(w), [1, 0]), {}, (f"{w}.t",)),
            Step(StepKind.ATEN, "aten.mm.default", (Buf("x"), Buf(f"{w}.t")), {}, (out,)),
        ]

    big = TensorSpec("bfloat16", ("16384", "2048"))  # 64 MiB
    program = Program(
        inputs=(),
        weights=(NamedTensor("wo", TensorSpec("bfloat16", ("2048", "2048"))), NamedTensor("wgu", big)),
        buffers={},
        steps=(
            Step(StepKind.ATEN, "aten.relu.default", (Buf("x"),), {}, ("a",)),
            *mm("wo", "o"),
            *mm("wgu", "g"),
        ),
        outputs=("g",),
        symbols=(),
    )
    ahead = ahead_weight(program, 0, AHEAD_MIB)
    assert (ahead.weight, ahead.dtype, ahead.nbytes) == ("wgu", "bfloat16", 16 * MIB)
    assert ahead_weight(program, 0, 256).nbytes == 64 * MIB  # the whole weight where smaller
    assert ahead_weight(program, 2, AHEAD_MIB) is None  # after o: one weight-reading step left
    monkeypatch.setenv("AOTPACK_ATTENTION_AHEAD", "257")
    from aot.codegen.decode_attention import ahead_setting

    with pytest.raises(CodegenError, match="'257': expected 'off', 'on' \\(16 MiB\\) or MiB from 1 to 256"):
        ahead_setting()


@pytest.mark.slow
def test_the_attention_programs_compute_as_before_in_the_interpreter(on, tmp_path):
    from tests.codegen.conftest import assert_decode_kernels_match

    checks = assert_decode_kernels_match(on, tmp_path / "ahead.tpk", "decode_attention")
    assert all(name.endswith("_ahead") for name, *_ in checks if name.startswith("decode_attention"))


def test_the_sm90_code_prefetches_after_the_wait(on):
    """Compiled as the build compiles sm_90 (``GDC`` true): one bulk prefetch, in the side
    programs' branch, after a dependent-launch wait; the kernel without the setting has none."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aot.codegen.compile import load_function

    (_, _, kernel), *_ = _attention_steps(on)
    fn = load_function(kernel.id, kernel.name, kernel.source, True)
    comment = re.search(r"^    # (.*: .*)$", kernel.source, re.M).group(1)
    signature = dict(pair.split(": ") for pair in comment.split(", "))
    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(
        ASTSource(fn, signature=signature), target=target, options={"num_warps": kernel.num_warps}
    )
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.prefetch.L2.global")
