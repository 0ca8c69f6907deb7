"""Mixture-of-Experts causal LMs at transformers' default experts implementation (Mixtral,
Qwen2-MoE with its shared expert, Qwen3-MoE, GPT-OSS with expert biases and its own gate; tiny
random-weight configs, fp32, CPU).

``aot.experts`` exports each experts module as static-shape grouped GEMMs over the routed
rows sorted by expert; the build's reference check and every comparison here run the library's own
forward. Checked: the grouped form equals the library's ``eager`` loop and ``grouped_mm`` at token
counts where some experts get no row or one expert gets all (1e-5); the bundle's prefill and decode
logits equal the eager model's at batch 1, an odd size and the maximum (fp32: 1e-4 absolute + 1e-4
relative, ``aot.dtypes.TOLERANCE``); ``generate`` picks transformers' greedy tokens exactly. Mixtral
builds in the default run, the others in the slow run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aot.errors import TraceError
from tests.realmodels.conftest import unusable

MAX_BATCH, MAX_CONTEXT = 4, 16
NEW_TOKENS = 6
EXACT = 1e-5  # the grouped form against the library's forms: the same products, summed alike
COMMON = dict(
    vocab_size=96,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    initializer_range=0.3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
MOE = {
    "mixtral": ("Mixtral", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (  # a shared expert beside the routed ones, top-k weights not renormalized
        "Qwen2Moe",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=8,
        ),
    ),
}
# DBRX: flat expert weights ([E * F, H] each, aot.experts.flat_glu), its own loop over the
# experts hit, q/k/v clipped; its config names its sizes its own way (its clip must be set: with
# none, transformers' own forward fails)
DBRX = dict(
    d_model=32,
    n_heads=4,
    n_layers=2,
    max_seq_len=64,
    attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
    ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
)
# JetMoE: a router that reads its rows per expert with .tolist(), experts that split the rows by
# them (aot.experts.split_experts), in the MLP and in the attention's query/output projections
# (a mixture of attention heads); its attention heads are its KV heads times top-k
JETMOE = dict(
    kv_channels=8,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
)
KINDS = [
    "mixtral",
    pytest.param("qwen2_moe", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("gpt_oss", marks=pytest.mark.slow),
    pytest.param("dbrx", marks=pytest.mark.slow),
    pytest.param("jetmoe", marks=pytest.mark.slow),
]


@pytest.fixture(autouse=True)
def _transformers():
    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)


def factory(kind: str, experts_implementation: str | None = None):
    import transformers as tf

    if kind == "gpt_oss":
        return lambda: experts_models(kind, experts_implementation)
    if kind == "dbrx":
        keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")
        config = tf.DbrxConfig(**{k: COMMON[k] for k in keep}, **DBRX)
        return lambda: tf.DbrxForCausalLM(config)
    if kind == "jetmoe":
        fields = {k: v for k, v in COMMON.items() if k != "num_attention_heads"}
        return lambda: tf.JetMoeForCausalLM(tf.JetMoeConfig(**fields, **JETMOE))

    name, fields = MOE[kind]
    config = getattr(tf, f"{name}Config")(**{**COMMON, **fields})
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return lambda: getattr(tf, f"{name}ForCausalLM")(config)


def built(kind: str, seed: int = 0, experts_implementation: str | None = None):
    torch.manual_seed(seed)
    return factory(kind, experts_implementation)().eval()


def experts_of(model) -> nn.Module:
    return model.model.layers[0].mlp.experts


def routings(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    """Routings of ``tokens`` tokens: random (some experts get no row at small counts), and every
    token on the same top-k experts (the others get none)."""
    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    yield index, weights
    same = torch.arange(top_k).flip(0).expand(tokens, top_k).contiguous()
    yield same, weights


def mixture(experts, hidden, index, weights) -> torch.Tensor:
    """The mixture written out: every token through its k experts, one at a time, in the module's
    own layout (stacked [E, N, K], or [E, K, N] when transposed), biases and gating."""
    transposed = getattr(experts, "is_transposed", False)
    bias = getattr(experts, "has_bias", False)
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            up = hidden[t] @ (experts.gate_up_proj[e] if transposed else experts.gate_up_proj[e].T)
            up = up + experts.gate_up_proj_bias[e] if bias else up
            gated = experts._apply_gate(up[None])[0]
            down = gated @ (experts.down_proj[e] if transposed else experts.down_proj[e].T)
            out[t] += weights[t, j] * (down + experts.down_proj_bias[e] if bias else down)
    return out


GPT_OSS = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8)


def experts_models(kind: str, implementation: str | None):
    if kind != "gpt_oss":
        return built(kind, experts_implementation=implementation)
    import transformers as tf

    # weights stored transposed ([E, K, N]), biases, an interleaved and clamped gate of its own;
    # attention sinks, and sliding layers whose window (128) the context never reaches
    config = tf.GptOssConfig(**{**COMMON, **GPT_OSS})
    if implementation is not None:
        config._experts_implementation = implementation
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(config).eval()
    for layer in model.model.layers:
        for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
            bias.data.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", [*MOE, "gpt_oss"])
def test_the_grouped_form_equals_the_library_experts_forward(kind):
    from aot.experts import grouped_experts, replaceable

    for implementation in ("eager", "grouped_mm"):
        model = experts_models(kind, implementation)
        experts = experts_of(model)
        assert replaceable(experts), implementation
        top_k = model.config.num_experts_per_tok
        gen = torch.Generator().manual_seed(3)
        for tokens in (1, 7, 33):
            hidden = torch.randn(tokens, COMMON["hidden_size"], generator=gen)
            for index, weights in routings(tokens, experts.num_experts, top_k, gen):
                with torch.no_grad():
                    want = experts(hidden, index, weights)
                    with grouped_experts(model) as found:
                        assert found == COMMON["num_hidden_layers"]
                        got = experts(hidden, index, weights)
                    written = mixture(experts, hidden, index, weights)
                torch.testing.assert_close(got, want, atol=EXACT, rtol=EXACT)
                torch.testing.assert_close(got, written, atol=EXACT, rtol=EXACT)


class StackedExperts(nn.Module):
    """Not a transformers class: stacked expert weights and the routing as computed."""

    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * intermediate, hidden) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, intermediate) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):  # a loop over tokens: what export cannot hold
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                gate, up = (hidden_states[t] @ self.gate_up_proj[e].T).chunk(2)
                out[t] += top_k_weights[t, j] * (self.act_fn(gate) * up) @ self.down_proj[e].T
        return out


def test_experts_are_found_by_structure_and_restored_after_export():
    from aot.experts import grouped_experts, is_experts_module

    class Other(nn.Module):  # stacked weights, but no routing in its forward
        def __init__(self):
            super().__init__()
            self.num_experts = 2
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
            self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))

        def forward(self, x):
            return x

    model = nn.ModuleDict({"moe": StackedExperts(4, 8, 8), "other": Other(), "linear": nn.Linear(4, 4)})
    assert [is_experts_module(m) for m in model.values()] == [True, False, False]
    hidden = torch.randn(5, 8)
    index = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 0], [0, 1]])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        want = model["moe"](hidden, index, weights)
        with grouped_experts(model) as found:
            assert found == 1 and "forward" in vars(model["moe"])
            got = model["moe"](hidden, index, weights)
        assert "forward" not in vars(model["moe"])
    torch.testing.assert_close(got, want, atol=EXACT, rtol=EXACT)


def test_dbrx_flat_experts_are_found_and_the_grouped_form_equals_their_loop():
    """DBRX's experts (``DbrxExperts``: flat ``[E * F, H]`` weights under ``mlp``, no
    ``gate_up_proj``, a loop over the experts hit): found by structure, and the grouped form equals
    its own forward and the mixture written out, token by token, for 2-D and 3-D hidden states (it
    returns ``[hidden_states.shape[0], -1, H]`` either way), where some experts get no row and
    where one gets every row."""
    from aot.experts import flat_glu, grouped_experts, replaceable

    model = built("dbrx")
    experts = model.transformer.blocks[0].ffn.experts
    assert replaceable(experts) and not hasattr(experts, "gate_up_proj")
    gate, up, down = flat_glu(experts)
    assert gate.shape == up.shape == down.shape == (4, 64, 32)
    gen = torch.Generator().manual_seed(5)
    for shape in ((1, 32), (7, 32), (2, 9, 32)):
        hidden = torch.randn(*shape, generator=gen)
        tokens = hidden.numel() // 32
        for index, weights in routings(tokens, 4, 2, gen):
            with torch.no_grad():
                want = experts(hidden, index, weights)
                with grouped_experts(model) as found:
                    assert found == DBRX["n_layers"]
                    got = experts(hidden, index, weights)
                rows = hidden.reshape(-1, 32)
                written = torch.zeros_like(rows)
                for t in range(tokens):
                    for j in range(2):
                        e = int(index[t, j])
                        h = nn.functional.silu(rows[t] @ gate[e].T) * (rows[t] @ up[e].T)
                        written[t] += weights[t, j] * (h @ down[e])
            assert got.shape == want.shape == (shape[0], tokens // shape[0], 32)
            torch.testing.assert_close(got, want, atol=EXACT, rtol=EXACT)
            torch.testing.assert_close(got.reshape(-1, 32), written, atol=EXACT, rtol=EXACT)


def test_jetmoe_split_experts_are_found_and_their_grouped_gemms_equal_the_library():
    """JetMoE's parallel experts (``[E, N, K]`` weights, ``forward(inputs, expert_size)``) are
    found with the router beside each, in the MLP and the attention alike. Under
    ``grouped_experts`` the router's counts stay a tensor and each experts module is one grouped
    GEMM: the MLP's and the attention's outputs equal the library's (1e-5) at 1, 3 and 17 tokens
    (at one token two of the four experts get no row), and with a router that sends every token to
    the same two experts."""
    from aot.experts import grouped_experts, is_split_experts, split_experts

    model = built("jetmoe")
    layer = model.model.layers[0]
    moe, moa = layer.mlp, layer.self_attention.experts
    found = split_experts(model)
    assert set(map(id, found)) == {
        id(m)
        for block in model.model.layers
        for m in (block.mlp, block.self_attention.experts)
        for m in (m.input_linear, m.output_linear)
    }
    assert found[moe.input_linear] == [moe.router] and found[moa.output_linear] == [moa.router]
    assert not is_split_experts(moe.router)

    gen = torch.Generator().manual_seed(7)
    for same in (False, True):
        if same:  # every logit equal: top-k picks the first two experts for every token
            for block in model.model.layers:
                for m in (block.mlp, block.self_attention.experts):
                    m.router.layer.weight.data.zero_()
        for tokens in (1, 3, 17):
            hidden = torch.randn(1, tokens, COMMON["hidden_size"], generator=gen)
            with torch.no_grad():
                want = (
                    moe(hidden),
                    layer.self_attention(hidden, position_embeddings=_rope(model, tokens))[0],
                )
                with grouped_experts(model) as count:
                    assert count == 4 * COMMON["num_hidden_layers"]
                    assert all("forward" in vars(m) for m in (moe.input_linear, moe.router))
                    got = (
                        moe(hidden),
                        layer.self_attention(hidden, position_embeddings=_rope(model, tokens))[0],
                    )
                assert not any("forward" in vars(m) for m in (moe.input_linear, moe.router))
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=EXACT, rtol=EXACT)


def _rope(model, tokens: int):
    positions = torch.arange(tokens)[None]
    return model.model.rotary_emb(torch.zeros(1, tokens, COMMON["hidden_size"]), positions)


def test_split_experts_without_their_router_or_read_as_a_list_are_refused():
    """The counts ``.tolist()`` gives in a router's forward under ``grouped_experts`` are a tensor:
    read as a list they say why not; and experts given a plain list of sizes (a router that is not
    the one beside them) say so. A module of 3-D weights whose forward does not take the sizes is
    not a split experts module, and one with no router beside it is left alone."""
    from aot.experts import DeviceCounts, grouped_experts, is_split_experts, split_experts

    model = built("jetmoe")
    moe = model.model.layers[0].mlp
    counts = DeviceCounts(torch.tensor([1, 0, 2, 3]))
    assert counts.offsets().tolist() == [1, 1, 3, 6] and counts.offsets().dtype == torch.int32
    with pytest.raises(TraceError, match=r"rows per expert were read into Python \(\.tolist\(\)\)"):
        list(counts)
    with grouped_experts(model), pytest.raises(TraceError) as e:
        moe.input_linear(torch.randn(6, 32), [1, 0, 2, 3])
    assert str(e.value) == (
        "JetMoeParallelExperts was given its rows per expert as list, not as its router's counts: the router "
        "beside it is not the one that counted them"
    )

    class Plain(nn.Module):  # stacked weights, a forward of one argument
        def __init__(self):
            super().__init__()
            self.num_experts = 2
            self.weight = nn.Parameter(torch.zeros(2, 4, 4))

        def forward(self, x):
            return x

    alone = nn.ModuleDict({"experts": moe.input_linear, "plain": Plain()})
    assert is_split_experts(moe.input_linear) and not is_split_experts(alone["plain"])
    assert split_experts(alone) == {}


def test_switch_experts_kept_as_modules_are_found_and_their_grouped_gemms_equal_the_library():
    """Switch Transformers' experts (``expert_0`` ... as modules of their own, ``wi``, act, ``wo``;
    a one-hot dispatch mask ``[T, 1, E]``, all zero for a token past its expert's capacity) are
    found by structure; under ``grouped_experts`` the mixture runs as grouped GEMMs over the
    stacked weights and equals the library's loop (1e-5) with tokens on every expert, on one, and
    past capacity (their rows 0)."""
    from aot.experts import grouped_experts, module_experts
    from tests.hf.test_seq2seq import built as built_seq2seq

    model = built_seq2seq("switch")  # d_model 32, 4 experts, one sparse layer each side
    mlp = next(m for m in model.modules() if type(m).__name__ == "SwitchTransformersSparseMLP")
    experts = mlp.experts
    found = module_experts(experts)
    assert found is not None and [up for up, _, _ in found] == [experts[f"expert_{e}"].wi for e in range(4)]
    assert module_experts(mlp) is None  # the router's and the experts' parent
    gen = torch.Generator().manual_seed(9)
    for tokens in (1, 6, 13):
        hidden = torch.randn(tokens, 32, generator=gen)
        choice = torch.randint(0, 4, (tokens,), generator=gen)
        for dispatch in (
            nn.functional.one_hot(choice, 4),  # each token on its own expert
            nn.functional.one_hot(torch.zeros_like(choice), 4),  # every token on expert 0
            nn.functional.one_hot(choice, 4) * (torch.arange(tokens) % 3 != 1)[:, None],  # some past capacity
        ):
            weights = torch.rand(tokens, 1, generator=gen)
            with torch.no_grad():
                want = experts(hidden, dispatch[:, None, :], weights)
                with grouped_experts(model) as count:
                    assert count == 2  # one sparse layer in the encoder, one in the decoder
                    got = experts(hidden, dispatch[:, None, :], weights)
            assert "forward" not in vars(experts)
            torch.testing.assert_close(got, want, atol=EXACT, rtol=EXACT)
            dropped = dispatch.sum(-1) == 0
            assert dropped.any() == (got[dropped].numel() > 0) and not got[dropped].any()


def test_a_model_that_fails_as_configured_is_refused_as_such():
    """DBRX without its q/k/v clip fails in transformers' own forward (a clamp given no bounds).
    ``causal_lm`` probes it on the meta device, where the model without a cache stops first at a
    value it reads, so it cannot tell the model's failure from a state the cache lacks: it says
    both, the model's first (its config names no layer kind of other state)."""
    import transformers as tf

    from aot.errors import SpecError
    from aot.hf import causal_lm

    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")
    fields = {**DBRX, "attn_config": {**DBRX["attn_config"], "clip_qkv": None}}
    config = tf.DbrxConfig(**{k: COMMON[k] for k in keep}, **fields)
    with pytest.raises(SpecError) as e:
        causal_lm(lambda: tf.DbrxForCausalLM(config), max_batch=2, max_context=MAX_CONTEXT)
    message = str(e.value)
    assert message.startswith(
        "causal_lm cannot serve DbrxForCausalLM: one token through it with a key/value cache as past_key_values "
        "fails (ValueError: clamp called but both min and max are none!). Either the model fails as configured "
        "(run one token through it to see), or a layer keeps a state other than keys and values: causal_lm serves"
    ), message


def test_expert_sizes_the_grouped_gemm_cannot_read_are_refused_with_the_sizes():
    from aot.experts import grouped_experts_forward

    experts = StackedExperts(4, 6, 8)  # hidden 6: 24-byte rows
    with pytest.raises(TraceError) as e:
        grouped_experts_forward(
            experts, torch.randn(3, 6), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
        )
    assert str(e.value) == (
        "StackedExperts: expert weights of sizes [6, 8, 16] (torch.float32) cannot run as grouped GEMMs: every "
        "expert dim times 4 bytes must be a multiple of 16 bytes, [6] are not; use hidden and intermediate sizes "
        "that are multiples of 4"
    )


class MoeBundles:
    """Each kind's bundle, built once: (runner, the eager module the build compared against)."""

    def __init__(self, base):
        self.base = base
        self._made: dict[str, tuple] = {}

    def __call__(self, kind: str):
        if kind not in self._made:
            import aot.loader
            from aot.codegen import generate
            from aot.hf import causal_lm
            from aot.packager import pack
            from aot.tracer import instantiate, trace

            spec = causal_lm(factory(kind), max_batch=MAX_BATCH, max_context=MAX_CONTEXT, name=kind)
            path = self.base / f"{kind}.tpk"
            pack(generate(trace(spec), ("sm_90",)), path)
            self._made[kind] = (aot.loader.load(path), instantiate(spec))
        return self._made[kind]


@pytest.fixture(scope="session")
def moe_bundles(tmp_path_factory):
    return MoeBundles(tmp_path_factory.mktemp("moe_bundles"))


def _call(batch: int, seq: int, start: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``seq`` tokens per row written at slots ``start..``, every earlier slot valid."""
    slots = torch.arange(start, start + seq)
    mask = torch.zeros(batch, MAX_CONTEXT, dtype=torch.int64)
    mask[:, : start + seq] = 1
    return {
        "input_ids": torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=gen),
        "position_ids": slots.expand(batch, seq).clone(),
        "cache_position": slots,
        "attention_mask": mask,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_equal_eager_at_min_odd_and_max_sizes(moe_bundles, kind):
    from aot.dtypes import TOLERANCE

    runner, module = moe_bundles(kind)
    tol = TOLERANCE["float32"]
    gen = torch.Generator().manual_seed(11)
    # (batch, seq, first slot): a decode step follows each prefill where a slot is left
    for batch, seq, start in (
        (1, 1, 0),
        (3, 5, 4),
        (MAX_BATCH, MAX_CONTEXT - 1, 0),
        (MAX_BATCH, MAX_CONTEXT, 0),
    ):
        runner.reset()
        state = {n: torch.zeros_like(t[:batch]) for n, t in runner.state.tensors.items()}
        calls = [("prefill", _call(batch, seq, start, gen))]
        if start + seq < MAX_CONTEXT:
            calls.append(("decode", _call(batch, 1, start + seq, gen)))
        with torch.no_grad():
            want = [module(**inputs, **state) for _, inputs in calls]
        got = [runner.entry(entry)(**inputs) for entry, inputs in calls]
        for step, g, w in zip([entry for entry, _ in calls], got, want):
            assert g.shape == (batch, COMMON["vocab_size"])
            torch.testing.assert_close(
                g, w, atol=tol.atol, rtol=tol.rtol, msg=lambda m, s=step, b=batch: f"{s} at batch {b}: {m}"
            )


@pytest.mark.parametrize("kind", KINDS)
def test_generate_equals_transformers_greedy_generate(moe_bundles, kind):
    from tests.hf.test_causal_lm import hf_greedy, prompts

    runner, _ = moe_bundles(kind)
    model = built(kind)
    if kind not in ("dbrx", "jetmoe"):  # their experts have one implementation each
        assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    ids, mask = prompts(3)  # rows 1 and 2 left-padded
    want, _ = hf_greedy(model, ids, mask, NEW_TOKENS)
    assert runner.generate(ids, NEW_TOKENS, attention_mask=mask) == want.tolist()
    assert len(set(want.flatten().tolist())) > 2, "the tokens barely vary; the comparison would prove little"
    one, _ = hf_greedy(model, ids[:1], mask[:1], NEW_TOKENS)
    assert runner.generate(ids[0].tolist(), NEW_TOKENS) == one[0].tolist()


def test_each_expert_layer_is_two_grouped_gemm_kernels_over_allowlisted_ops(moe_bundles):
    """Both entry points: every op is allowlisted (no ``transformers::`` op, no loop over the
    experts that were hit), and each layer's gate/up and down projections are grouped GEMM kernel
    steps whose reference (the CPU's path) is ``aten._grouped_mm`` (after the gather of the routed
    rows, for gate/up)."""
    from aot.allowed_ops import ALLOWED_OPS, STATE_WRITE_OPS
    from aot.schema import StepKind

    runner, _ = moe_bundles("mixtral")
    for program in (runner.program, *runner.program.variants):
        kernels = {k.id: k for k in program.kernels}
        grouped = [
            s
            for s in program.steps
            if s.kind == StepKind.KERNEL and kernels[s.target].config.get("kind") == "grouped_gemm"
        ]
        assert len(grouped) == 2 * COMMON["num_hidden_layers"]
        # gate/up reads each routed row where its token lies (the gather folded in), down what gate/up wrote
        references = sorted(tuple(r.target for r in s.reference) for s in grouped)
        assert (
            references
            == [("aten._grouped_mm.default",)] * 2 + [("aten.index.Tensor", "aten._grouped_mm.default")] * 2
        )
        ops = {x.target for s in program.steps for x in ((s,) if s.kind == StepKind.ATEN else s.reference)}
        assert ops <= ALLOWED_OPS | STATE_WRITE_OPS, ops - ALLOWED_OPS
        assert "aten._grouped_mm.default" not in {s.target for s in program.steps}


@pytest.mark.slow
def test_every_kernel_of_the_moe_bundle_matches_its_reference_in_the_interpreter(moe_bundles, tmp_path):
    """The prefill program's kernels (the grouped GEMMs, the offsets' reduction, the fused
    routing and gating) in Triton's interpreter against their ATen references
    (``aot.dtypes.TOLERANCE``), at batch 1 and an odd size."""
    from aot.verify.interpret import interpret_in_subprocess
    from tests.conftest import HANG_GUARD_S
    from tests.realmodels.conftest import causal_lm_model_file

    runner, _ = moe_bundles("mixtral")
    model = tmp_path / "mixtral_model.py"
    model.write_text(
        causal_lm_model_file(
            "tests.lm.test_moe", "mixtral", max_batch=MAX_BATCH, max_context=MAX_CONTEXT, name="mixtral"
        )
    )
    bundle = moe_bundles.base / "mixtral.tpk"
    sizes = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 5}]
    (result,) = interpret_in_subprocess([(bundle, model, sizes, None)], timeout=HANG_GUARD_S)
    kernels = {k.id: k for k in runner.program.kernels}
    for key, comparisons in result.items():
        grouped = [c for c in comparisons if kernels[c.kernel].config.get("kind") == "grouped_gemm"]
        assert len(grouped) == 2 * COMMON["num_hidden_layers"], key
        bad = [c for c in comparisons if not c.ok]
        assert not bad, (key, bad[:3])
