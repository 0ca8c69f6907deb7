"""A norm's per-column scale folded into the weights of the projections that read it
(``aot.tracer.norm_scales``): ``(g * y) @ W^T = y @ (W * g)^T``, ``W * g`` computed once by the
build (a ``folded.`` weight; the original W leaves the bundle).

The unit model has three RMSNorms whose scale ``g`` meets three cases: ``norm1`` feeds q/k/v
linears alone (folded: its weights become folded ones and the multiply leaves the program);
``norm2`` feeds a linear and, beside it, an add (not folded: the add would see the unscaled
row); ``norm3`` feeds a head tied to the embedding (not folded: the embedding reads the same
weight). Each bundle equals eager on the CPU at batch 1, 3 and 4 (float32: 1e-5 of the output's
scale; bfloat16: the rounding of ``W * g`` against the reference's of ``g * y``, 2e-2 of scale),
and equals the unfolded build's. A mutation that scales W's rows instead of its columns, or
folds where another reader sees the norm's output, fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

DTYPE = torch.{dtype}

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.norm1, self.norm2, self.norm3 = RMSNorm(24), RMSNorm(24), RMSNorm(24)
        self.q, self.k, self.v = nn.Linear(24, 24, bias=False), nn.Linear(24, 8), nn.Linear(24, 8, bias=False)
        self.up = nn.Linear(24, 24, bias=False)
        self.head = nn.Linear(24, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        h = self.norm1(x)
        x = x + self.q(h) + torch.cat([self.k(h), self.v(h), self.k(h)], -1)
        h = self.norm2(x)
        x = x + self.up(h) + h  # the norm's output read beside the linear
        return self.head(self.norm3(x))

spec = ModelSpec(module=M, inputs=[Input("ids", (Dim("batch", 1, 4), 5), dtype="int64", low=0, high=40)], dtype="{dtype}")
"""


def _build(tmp_path, dtype: str, fold: str, model: str = MODEL):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.tracer.norm_scales import ENV

    path = tmp_path / f"norms_{dtype}.py"
    path.write_text(model.replace("{dtype}", dtype))
    spec = load_model_file(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, fold)
        traced = trace(spec)
    bundle = tmp_path / f"norms_{dtype}_{fold}.tpk"
    pack(generate(traced, ("sm_90",)), bundle)
    return spec, traced, bundle


def _compare(spec, bundle, apart_bundle, dtype: str) -> None:
    """The folded ``bundle`` against eager and the unfolded build at batch 1, 3 and 4: float32
    1e-5 of the output's scale, half precision 2e-2 (the weights' one rounding against the
    reference's rounding of the norm's output)."""
    from aot.loader import load
    from aot.tracer.model import instantiate

    module = instantiate(spec)
    runner, unfolded = load(bundle), load(apart_bundle)
    for batch in (1, 3, 4):
        ids = torch.randint(0, 40, (batch, 5), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            expected = module(ids).float()
        got, other = runner(ids).float(), unfolded(ids).float()
        scale = max(1.0, expected.abs().max().item())
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(got, expected, rtol=0, atol=tol * scale)
        torch.testing.assert_close(got, other, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_norms_scale_folds_into_the_projections_that_alone_read_it(tmp_path, dtype):
    from aot.tracer.folding import FOLDED_PREFIX

    spec, traced, bundle = _build(tmp_path, dtype, "on")
    _, apart, apart_bundle = _build(tmp_path, dtype, "off")
    names = {w.name for w in traced.program.weights}
    # norm1's q/k/v weights are folded and leave the bundle; norm1's weight too (read by nothing)
    assert not names & {"q.weight", "k.weight", "v.weight", "norm1.weight"}, sorted(names)
    assert sum(n.startswith(FOLDED_PREFIX) for n in names) == 3, sorted(names)
    # norm2 (read beside its linear) and norm3 (before the tied head) keep their scales
    assert {"up.weight", "norm2.weight", "norm3.weight", "embed.weight", "k.bias"} <= names, sorted(names)
    assert not any(n.startswith(FOLDED_PREFIX) for n in {w.name for w in apart.program.weights})
    muls = lambda t: sum(s.target == "aten.mul.Tensor" for s in t.program.steps)  # noqa: E731
    assert muls(traced) == muls(apart) - 1

    _compare(spec, bundle, apart_bundle, dtype)


def test_the_fold_is_a_setting(tmp_path, monkeypatch):
    from aot.errors import CodegenError
    from aot.tracer.norm_scales import DEFAULT, ENV, mode

    monkeypatch.setenv(ENV, "of")
    with pytest.raises(CodegenError, match=ENV):
        mode()
    monkeypatch.setenv(ENV, "OFF")
    assert mode() == "off"
    monkeypatch.delenv(ENV)
    assert mode() == DEFAULT


def test_only_a_transpose_that_swaps_the_dims_reads_w_transposed():
    """``transpose(W, d, d)`` is W as it is: a matmul over it reads W's rows along K, where the
    fold would scale the wrong dim."""
    from aot.tracer.norm_scales import ATEN, _transposed_weight

    graph = torch.fx.Graph()
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(3, 3)
    weights = {w: torch.empty(3, 3)}
    same = graph.call_function(ATEN.transpose.int, (w, 1, 1))
    swapped = graph.call_function(ATEN.transpose.int, (w, 0, -1))
    t = graph.call_function(ATEN.t.default, (w,))
    kept = graph.call_function(ATEN.permute.default, (w, [0, 1]))
    assert _transposed_weight(same, weights) is None
    assert _transposed_weight(kept, weights) is None
    assert _transposed_weight(swapped, weights) is w and _transposed_weight(t, weights) is w


LAYER_NORMS = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

def norm(d):
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(d))
        ln.bias.copy_(0.5 * torch.randn(d))
    return ln

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.ln1, self.ln2, self.ln3 = norm(24), norm(24), norm(24)
        self.qkv = nn.Linear(24, 48)
        self.conv_w = nn.Parameter(0.2 * torch.randn(24, 16))  # GPT-2's Conv1D: W [K, N], read as is
        self.conv_b = nn.Parameter(torch.randn(16))
        self.plain = nn.Linear(24, 8, bias=False)
        self.up = nn.Linear(24, 24)
        self.head = nn.Linear(24, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        h = self.ln1(x)
        conv = torch.addmm(self.conv_b, h.view(-1, 24), self.conv_w).view(*h.shape[:-1], 16)
        x = x + self.qkv(h)[..., :24] + torch.cat([conv, self.plain(h)], -1)
        h = self.ln2(x)
        x = x + self.up(h) + h  # the norm's output read beside the linear
        return self.head(self.ln3(x))

spec = ModelSpec(module=M, inputs=[Input("ids", (Dim("batch", 1, 4), 5), dtype="int64", low=0, high=40)], dtype="{dtype}")
"""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_layer_norms_scale_and_shift_fold_into_the_projections_that_alone_read_it(tmp_path, dtype):
    """``LN(x) @ W^T + b = norm(x) @ (W * scale)^T + (b + W @ shift)``: ``ln1`` feeds a linear with
    a bias, a Conv1D-style ``addmm`` over W [K, N] and a linear without a bias (which becomes an
    ``addmm`` of ``W @ shift``); all fold and ``ln1`` keeps no scale or shift. ``ln2`` (read beside
    its linear) and ``ln3`` (before the tied head) keep theirs. Against eager: float32 1e-5 of the
    output's scale, float16 2e-2 (``W * scale`` and ``b + W @ shift`` rounded once where the
    reference rounds the LayerNorm's output each call). A mutation that reads W scaled in
    ``W @ shift``, or scales W's other dim, fails it."""
    from aot.tracer.folding import FOLDED_PREFIX

    spec, traced, bundle = _build(tmp_path, dtype, "on", LAYER_NORMS)
    _, apart, apart_bundle = _build(tmp_path, dtype, "rms", LAYER_NORMS)
    names = {w.name for w in traced.program.weights}
    folded_away = {"qkv.weight", "qkv.bias", "conv_w", "conv_b", "plain.weight", "ln1.weight", "ln1.bias"}
    assert not names & folded_away, sorted(names)
    # W * scale for the three; b + W @ shift for qkv and conv, W @ shift alone for plain
    assert sum(n.startswith(FOLDED_PREFIX) for n in names) == 6, sorted(names)
    assert {"ln2.weight", "ln2.bias", "up.weight", "ln3.weight", "ln3.bias", "embed.weight"} <= names
    assert folded_away <= {w.name for w in apart.program.weights}
    (ln1,) = [s for s in traced.program.steps if s.target == "aten.native_layer_norm.default"][:1]
    assert ln1.args[2] is None and ln1.args[3] is None

    _compare(spec, bundle, apart_bundle, dtype)


def test_transformers_gpt2_with_trained_looking_layer_norms_equals_eager(tmp_path):
    """transformers' GPT-2 (two layers, 64 wide, float32) whose LayerNorms carry random scales and
    shifts (its initialization gives 1 and 0, where the fold would change no value): ``ln_1``
    folds into each layer's ``c_attn``, ``ln_2`` into ``c_fc`` (Conv1D weights [K, N]); ``ln_f``
    before the tied head does not. The bundle equals eager (1e-5 of the logits' scale)."""
    from tests.realmodels.conftest import require

    require("transformers")
    import transformers as tf

    from aot import Dim, Input, ModelSpec
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from aot.tracer.folding import FOLDED_PREFIX
    from aot.tracer.model import instantiate
    from tests.realmodels.zoo import trained_norms

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=96)
            self.model = trained_norms(tf.GPT2LMHeadModel(cfg).eval())

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    spec = ModelSpec(
        module=Logits, inputs=[Input("ids", (Dim("batch", 1, 3), 7), dtype="int64", low=0, high=96)]
    )
    traced = trace(spec)
    names = {w.name for w in traced.program.weights}
    assert not {n for n in names if ".ln_1." in n or ".ln_2." in n}, sorted(names)
    assert {"model.transformer.ln_f.weight", "model.transformer.ln_f.bias"} <= names
    assert sum(n.startswith(FOLDED_PREFIX) for n in names) == 8  # c_attn, c_fc: W and bias, 2 layers
    pack(generate(traced, ("sm_90",)), tmp_path / "gpt2.tpk")
    module = instantiate(spec)
    runner = load(tmp_path / "gpt2.tpk")
    for batch in (1, 3):
        ids = torch.randint(0, 96, (batch, 7), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            expected = module(ids)
        got = runner(ids)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
