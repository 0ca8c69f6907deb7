"""Bundles of unmodified transformers causal LMs (``aot.hf.causal_lm``) generate exactly the tokens
of transformers' greedy ``generate`` (fp32, CPU): tiny random-weight GPT-2 and Llama (grouped-
query) configs by default, Qwen2, Mistral (sliding window), Falcon (multi-query), GPT-Neo
(eager attention), GPT-J (eager attention run as SDPA at one query), CodeGen, GPT-NeoX,
DeepSeek-V3 (multi-head latent attention, mixture of experts), DeepSeek-V2 and Llama 4 (rotary
embeddings in complex numbers) in the slow run. Each bundle is built once per session; the configs and the reference ``generate`` call are
those of tests/hf."""

from __future__ import annotations

import unittest.mock

import pytest
import torch

from aot.allowed_ops import STATE_WRITE_OPS
from aot.errors import GuardError
from aot.schema import StepKind
from tests.conftest import run_aotpack
from tests.realmodels.conftest import unusable

MAX_BATCH, MAX_CONTEXT = 4, 16
NEW_TOKENS = 6
CONTEXT_BUCKETS = (4, 8)  # and MAX_CONTEXT: a 5-token prompt + 6 tokens crosses from 8 to 16
KINDS = [
    "gpt2",
    "llama",
    pytest.param("qwen2", marks=pytest.mark.slow),
    pytest.param("mistral", marks=pytest.mark.slow),
    # multi-query: one KV head its SDPA call broadcasts against the query heads
    pytest.param("falcon", marks=pytest.mark.slow),
    # eager attention (matmuls and a softmax, no SDPA call), a local layer spanning the context
    pytest.param("gpt_neo", marks=pytest.mark.slow),
    # eager attention its decode program runs as SDPA (aot.codegen.attention.eager_attention_as_sdpa)
    pytest.param("gptj", marks=pytest.mark.slow),
    # the same, its mask added before the scale (passed to SDPA scaled)
    pytest.param("codegen", marks=pytest.mark.slow),
    # each head's query, key and value side by side in the projection's rows: the decode kernel
    # reads the new keys and values heads 3 * D apart
    pytest.param("gpt_neox", marks=pytest.mark.slow),
    # multi-head latent attention over a compressed cache, mixture-of-experts layers
    pytest.param("deepseek_v3", marks=pytest.mark.slow),
    # rotary embeddings in complex numbers, run as real pairs
    pytest.param("deepseek_v2", marks=pytest.mark.slow),
    pytest.param("llama4", marks=pytest.mark.slow),
    # sliding-window layers beside full ones, the window shorter than prompt and tokens: a mask per
    # kind of layer
    pytest.param("qwen2_window", marks=pytest.mark.slow),
    pytest.param("gemma3", marks=pytest.mark.slow),
    pytest.param("gemma2", marks=pytest.mark.slow),
    pytest.param("gpt_oss", marks=pytest.mark.slow),
    pytest.param("cohere2", marks=pytest.mark.slow),
    # Llama 4's attention in chunks of 4 slots beside a full layer
    pytest.param("llama4_chunked", marks=pytest.mark.slow),
]


class HfBundles:
    """Each kind's bundle and its eager model (as ModelSpec builds it), built once."""

    def __init__(self, base):
        self.base = base
        self._made: dict[str, tuple] = {}

    def __call__(self, kind: str):
        if kind not in self._made:
            import aot.loader
            from aot.codegen import generate
            from aot.hf import causal_lm
            from aot.packager import pack
            from aot.tracer import trace
            from tests.hf.test_causal_lm import built, factory

            model, _, sized = kind.partition("@")  # "llama@context": built with context buckets
            spec = causal_lm(
                factory(model),
                max_batch=MAX_BATCH,
                max_context=MAX_CONTEXT,
                name=model,
                context_buckets=CONTEXT_BUCKETS if sized else None,
            )
            path = self.base / f"{model}{'-' + sized if sized else ''}.tpk"
            pack(generate(trace(spec), ("sm_90",)), path)
            self._made[kind] = (path, aot.loader.load(path), built(model))
        return self._made[kind]


@pytest.fixture(scope="session")
def hf_bundles(tmp_path_factory):
    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    return HfBundles(tmp_path_factory.mktemp("hf_bundles"))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_equals_transformers_greedy_generate(hf_bundles, kind):
    from tests.hf.test_causal_lm import hf_greedy, prompts

    _, runner, model = hf_bundles(kind)
    ids, mask = prompts(3)  # rows 1 and 2 left-padded
    want, _ = hf_greedy(model, ids, mask, NEW_TOKENS)
    assert runner.generate(ids, NEW_TOKENS, attention_mask=mask) == want.tolist()
    one, _ = hf_greedy(model, ids[:1], mask[:1], NEW_TOKENS)
    assert runner.generate(ids[0].tolist(), NEW_TOKENS) == one[0].tolist()


def test_a_tokenizers_batch_passes_as_transformers_generate_takes_it(hf_bundles):
    """``generate(**batch, max_new_tokens=n)`` with a tokenizer's output (``input_ids`` and
    ``attention_mask``, left-padded) gives transformers' greedy tokens; the prompts given twice
    (``prompt_ids`` and ``input_ids``) are refused."""
    from tests.hf.test_causal_lm import hf_greedy, prompts

    _, runner, model = hf_bundles("llama")
    ids, mask = prompts(3)
    want, _ = hf_greedy(model, ids, mask, NEW_TOKENS)
    batch = {"input_ids": ids, "attention_mask": mask}
    assert runner.generate(**batch, max_new_tokens=NEW_TOKENS) == want.tolist()
    with pytest.raises(GuardError) as e:
        runner.generate(ids, NEW_TOKENS, input_ids=ids)
    assert str(e.value) == (
        "generate takes the prompts once: prompt_ids, or input_ids (transformers' name for them), not both"
    )


def test_eos_and_sampling(hf_bundles):
    _, runner, model = hf_bundles("llama")
    prompt = [5, 17, 33, 2]
    greedy = runner.generate(prompt, NEW_TOKENS)
    eos = greedy[2]
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert runner.generate(prompt, NEW_TOKENS, eos_token_id=eos) == hf[: hf.index(eos) + 1]
    a = runner.generate([prompt, [9, 9]], NEW_TOKENS, do_sample=True, temperature=2.0, seed=11)
    assert a == runner.generate([prompt, [9, 9]], NEW_TOKENS, do_sample=True, temperature=2.0, seed=11)
    assert a != runner.generate([prompt, [9, 9]], NEW_TOKENS, do_sample=True, temperature=2.0, seed=12)
    with pytest.raises(GuardError, match="needs 17 cache slots, the bundle's context holds 16"):
        runner.generate(list(range(1, 12)), 6)


def test_gpt2_conv1d_weights_are_stored_transposed_once_for_both_entry_points(hf_bundles):
    """GPT-2's Conv1D weights ([K, N], read by ``addmm(b, x, W)`` alone) are stored [N, K] under
    a new name (``aot.codegen.weight_layout``), by prefill and decode alike: the bundle holds each
    once, the original layout not at all (its attention output projection is square: a shape
    check alone could not tell the layouts apart). The two after a LayerNorm (``c_attn`` after
    ``ln_1``, ``c_fc`` after ``ln_2``) are stored with the LayerNorm's scale folded into their
    rows (``aot.tracer.norm_scales``: a ``folded.`` weight, as [N, K] too)."""
    from safetensors.torch import load

    from aot.loader.bundle import open_bundle
    from aot.schema import WEIGHTS_PATH

    path, runner, model = hf_bundles("gpt2")
    bundle = open_bundle(path)
    try:
        stored = load(bundle.read(WEIGHTS_PATH))
    finally:
        bundle.close()
    params = dict(model.named_parameters())
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 4 * 2  # c_attn, c_proj, c_fc, mlp c_proj; 2 layers
    after_norm = {m: m.rsplit(".", 2)[0] + (".ln_1" if m.endswith("c_attn") else ".ln_2") for m in conv1d}
    after_norm = {m: ln for m, ln in after_norm.items() if m.endswith(("c_attn", "c_fc"))}
    folded = {n: t for n, t in stored.items() if n.startswith("folded.") and n.endswith(".nk")}
    for program in (runner.program, *runner.program.variants):
        names = {w.name for w in program.weights}
        for module in conv1d:
            assert f"model.{module}.weight" not in names
            assert (f"model.{module}.weight.nk" in names) == (module not in after_norm)
    for module in conv1d:
        assert f"model.{module}.weight" not in stored
        w = params[f"{module}.weight"].detach()
        if module in after_norm:  # W * scale along K, [N, K]: one stored weight equals it
            scaled = (w * params[f"{after_norm[module]}.weight"].detach()[:, None]).t()
            assert sum(torch.equal(t, scaled) for t in folded.values()) == 1, module
        else:
            assert torch.equal(stored[f"model.{module}.weight.nk"], w.t())
    assert all(t.is_contiguous() for t in folded.values())
    square = stored["model.transformer.h.0.attn.c_proj.weight.nk"]
    assert square.shape == (32, 32) and square.is_contiguous()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cache_writes_run_in_place_in_both_entry_points(hf_bundles, kind):
    _, runner, _ = hf_bundles(kind)
    assert runner.entry_points == ("prefill", "decode")
    for program in (runner.program, *runner.program.variants):
        # a step of its own, or in the reference of the decode attention kernel that does the write
        writes = [x for s in program.steps for x in (s, *s.reference) if x.target in STATE_WRITE_OPS]
        assert len(writes) == len(program.state) == 2 * 2  # key and value, 2 layers
        assert sorted(s.args[0].name for s in writes) == sorted(program.state)
        assert "aten.copy_.default" not in {s.target for s in writes}
    text = runner.guards_text()
    assert "state key_cache_0: float32[batch, " in text
    assert f"program decode  admits  seq == 1; 1 <= batch <= {MAX_BATCH}\n" in text
    assert f"program prefill  admits  1 <= batch <= {MAX_BATCH}; 1 <= seq <= {MAX_CONTEXT}\n" in text


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decode_keeps_the_last_position_by_a_slice(hf_bundles, kind):
    """``aot.hf``'s wrapper keeps only the last position's logits: in decode (seq 1 as traced) by
    ``logits_to_keep=1``, a view, so the step runs no arange and no gather for it; prefill (a
    symbolic seq) keeps its index tensor. The tokens are transformers' (the tests above)."""
    _, runner, _ = hf_bundles(kind)
    for program in (runner.program, *runner.program.variants):
        decode = program.inputs[0].spec.shape[1] == "1"
        targets = {x.target for s in program.steps for x in (s, *s.reference)}
        assert ("aten.index.Tensor" in targets) != decode
        # the mask's aranges run inside its kernel; the index's ran on their own
        aranges = [s for s in program.steps if s.target.startswith("aten.arange")]
        assert bool(aranges) != decode


def test_cli_generate_and_load_on_a_transformers_bundle(hf_bundles):
    path, runner, _ = hf_bundles("gpt2")
    want = runner.generate([[3, 4, 5], [7]], NEW_TOKENS)
    done = run_aotpack("generate", str(path), "--prompt-ids", "3,4,5;7", "--max-new-tokens", str(NEW_TOKENS))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [" ".join(map(str, w)) for w in want]
    done = run_aotpack("load", str(path), "--iters", "2", "--warmup", "1")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


def test_decode_attends_over_the_grouped_kv_cache_in_place(hf_bundles):
    """Llama's repeat_kv (4 query heads over 2 KV heads) copies the cache every step in eager; the
    decode program's SDPA reads the state itself, its query heads folded into query rows. Prefill
    (a longer query) keeps the repeat. The tokens equal transformers' (the tests above). Decode's
    attention runs as a kernel of the build's own (``aot.codegen.decode_attention``) whose
    reference is that SDPA call."""
    _, runner, _ = hf_bundles("llama")
    prefill, decode = runner.program, runner.program.variants[0]

    def ops(program) -> list[str]:
        return [x.target for s in program.steps for x in (s, *s.reference)]

    assert "aten.clone.default" in ops(prefill)
    assert "aten.clone.default" not in ops(decode) and "aten.expand.default" not in ops(decode)
    # the cache writes: steps of their own, or folded into the decode attention kernel (its reference)
    every = [x for s in decode.steps for x in (s, *s.reference)]
    writes = {s.outputs[0]: s.args[0].name for s in every if s.target in STATE_WRITE_OPS}
    producer = {o: s for s in every for o in s.outputs}
    folded = [s for s in decode.steps if s.in_place]
    assert len(folded) == 2 and all(set(s.in_place.values()) <= set(decode.state) for s in folded)
    assert not any(s.target in STATE_WRITE_OPS for s in decode.steps)  # no index_put_ launch left
    # the slot the kernel writes is checked against the cache before every call, as index_put_'s was
    (entry,) = [e for e in runner._entries if e.program is decode]
    assert {(name, slots) for name, _, slots in entry.index_bounds} == {("cache_position", MAX_CONTEXT)}
    # each an SDPA step, or the reference of the decode attention kernel that replaced it
    attention = [
        x
        for s in decode.steps
        for x in (s, *s.reference)
        if x.target == "aten.scaled_dot_product_attention.default"
    ]
    assert len(attention) == 2
    for sdpa in attention:
        read = []
        for arg in sdpa.args[1:3]:
            name = arg.name
            while name not in writes and producer[name].target == "aten.slice.Tensor":
                name = producer[name].args[0].name  # a full slice of the cache: a view
            read.append(writes.get(name))
        assert read[0].startswith("key_cache_") and read[1].startswith("value_cache_")
        assert decode.buffers[sdpa.outputs[0]].shape[1:] == ("2", "2", "8")  # [B, KV, G, D]


def test_decode_attention_rotates_the_queries_and_keys_itself(hf_bundles):
    """Llama's rotary embedding (``q * cos + rotate_half(q) * sin``, a pointwise kernel for the
    queries and one for the keys of each layer) runs inside the decode attention kernel of every
    decode program: it reads the projection's rows and the step's cos/sin, no RoPE kernel is
    launched there, and the kernel's reference holds both RoPE kernels' steps (what the CPU runs,
    so the tokens above are the library's). The prefill program (queries of any length) keeps its
    two RoPE kernels per layer."""
    from aot.codegen.decode_sites import SDPA

    _, runner, _ = hf_bundles("llama")
    layers = 2

    def is_rope(steps) -> bool:
        targets = [s.target for s in steps]
        return "aten.neg.default" in targets and "aten.cat.default" in targets

    decoding = 0
    for program in (runner.program, *runner.program.variants):
        kernels = {k.id: k for k in program.kernels}
        launched = [s for s in program.steps if s.kind == StepKind.KERNEL]
        attention = [s for s in launched if kernels[s.target].config.get("kind") == "decode_attention"]
        rope = [s for s in launched if is_rope(s.reference) and s not in attention]
        if not attention:  # a prefill program: SDPA over the cache, after its RoPE kernels
            assert len(rope) == 2 * layers, [kernels[s.target].name for s in launched]
            continue
        decoding += 1
        assert len(attention) == layers and not rope, [kernels[s.target].name for s in launched]
        for step in attention:
            kernel = kernels[step.target]
            assert "_rope_" in kernel.name and "aten.neg.default" in kernel.ops
            targets = [r.target for r in step.reference]
            assert targets.count("aten.neg.default") == 2 and targets[-1] == SDPA, targets
            assert targets.index("aten.neg.default") < targets.index("aten.index_put_.default")
            read = {a.name for a in step.args if hasattr(a, "name")}
            rotated = {r.outputs[0] for r in step.reference if r.target == "aten.add.Tensor"}
            assert not read & rotated  # the un-rotated rows, not what a RoPE kernel wrote
        assert not {k.name for k in program.kernels} & {"fused_mul_neg_cat_add"}
    assert decoding >= 1


@pytest.mark.parametrize(
    "kind",
    [
        "gpt2@context",
        pytest.param("llama@context", marks=pytest.mark.slow),  # a bundle of its own: 16 CPU s
        pytest.param("mistral@context", marks=pytest.mark.slow),
    ],
)
def test_context_buckets_read_only_the_filled_slots_and_change_no_token(hf_bundles, kind):
    """With context buckets, attention_mask is [batch, context] and every program's attention
    reads cache slots 0..context-1 only; generate passes the smallest bucket covering the slots
    written so far (8, then 16 here), and the tokens are still transformers' greedy ones."""
    from tests.hf.test_causal_lm import hf_greedy, prompts

    _, runner, model = hf_bundles(kind)
    masks = {i.name: tuple(i.shape) for i in runner.manifest.guards.inputs}
    assert masks["attention_mask"] == ("batch", "context")
    for program in (runner.program, *runner.program.variants):
        attention = [s for s in program.steps if s.target == "aten.scaled_dot_product_attention.default"]
        assert attention
        for sdpa in attention:
            keys = program.buffers[sdpa.args[1].name].shape[2]  # keys: [B, H, context, D]
            assert keys == "context", keys
    if kind.startswith("llama"):  # grouped-query decode still reads the cache in place (no repeat_kv copy)
        decode = runner.program.variants[0]
        assert "aten.clone.default" not in [x.target for s in decode.steps for x in (s, *s.reference)]
    seen = []
    decode = runner.entry

    def watching(name):
        call = decode(name)

        def run(**inputs):
            seen.append(inputs["attention_mask"].shape[1])
            return call(**inputs)

        run.check_indices = call.check_indices
        return run

    ids, mask = prompts(3)
    want, _ = hf_greedy(model, ids, mask, NEW_TOKENS)
    with unittest.mock.patch.object(runner, "entry", watching):
        assert runner.generate(ids, NEW_TOKENS, attention_mask=mask) == want.tolist()
    assert seen == [8, 8, 8, 8, 16, 16]  # prefill (5 slots), then decode at slots 5..9


HALF_KINDS = [
    "gpt2",
    "llama",
    "qwen2",
    "mistral",
    "falcon",
    "phi",
    "phi3",
    "gemma",
    "gpt_neox",
    "opt",
    "gptj",
]
HALF_KINDS += ["qwen3", "stablelm", "mixtral", "gpt_bigcode", "gpt_neo", "codegen"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", HALF_KINDS)
def test_float16_bundles_open_and_their_decode_kernels_match_their_references(kind, tmp_path):
    """Every architecture of tests/hf built in float16, as a GPU serves it: the bundle opens (a
    float16 Falcon's and Phi's once failed every load: a GEMM form read a LayerNorm kernel's
    partial sum), and every kernel of its decode program, run by Triton's interpreter at batch 2
    (one row left-padded), matches its reference within float16's tolerance: each distinct
    kernel at its first launch (the second layer's kernels are the first's)."""
    import aot.loader
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.codegen.conftest import decode_kernel_checks
    from tests.hf.test_causal_lm import factory

    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    spec = causal_lm(factory(kind), max_batch=2, max_context=MAX_CONTEXT, name=kind, dtype="float16")
    path = tmp_path / f"{kind}.tpk"
    pack(generate(trace(spec), ("sm_90",)), path)
    aot.loader.load(path).bundle.close()
    checks = decode_kernel_checks(path, position=9, padding=2, launches=1)
    assert checks, "no kernel of the decode program was compared"
    assert all(ok for *_, ok in checks), [c for c in checks if not c[3]]
