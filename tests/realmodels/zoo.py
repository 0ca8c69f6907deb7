"""Tiny random-weight configs of real architectures, built unmodified from the libraries users
deploy (transformers, timm, torchvision): no wrappers, no downloads.

``ZOO[name]()`` returns the model's ``ModelSpec`` (the library is imported then, not before);
``ZOO[name].sizes`` are the sizes the GPU suite, the kernel check and ``bench/realmodels.py`` use
(batch 1 and seq 1, odd sizes, the maximum), while the CPU suite compares every declared size.
Declared ranges are small (batch 1..4, seq 1..32) so the whole suite runs on a 2-core CPU in a few
minutes; the architectures (attention masks, RoPE, GQA, relative position buckets, conv stems,
squeeze-excite, layer scale, ...) are the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aot import Dim, Input, ModelSpec
from tests.realmodels.conftest import import_torchvision

VOCAB = 96


@dataclass(frozen=True)
class Case:
    spec: Callable[[], ModelSpec]  # imports the library and builds the spec: lazily
    sizes: tuple[dict[str, int], ...]  # batch 1 (seq 1), odd sizes, the maximum: the GPU suite's and bench's
    library: str

    def __call__(self) -> ModelSpec:
        return self.spec()


def _tokens(*names: str, batch: Dim, seq: Dim, vocab: int = VOCAB) -> list[Input]:
    out = []
    for n in names:
        if n == "input_ids":
            out.append(Input(n, (batch, seq), dtype="int64", low=0, high=vocab))
        elif n == "attention_mask":
            out.append(Input(n, (batch, seq), dtype="int64", low=1, high=2))
        elif n == "token_type_ids":
            out.append(Input(n, (batch, seq), dtype="int64", low=0, high=2))
    return out


TEXT_SIZES = (
    {"batch": 1, "seq": 1},
    {"batch": 1, "seq": 7},
    {"batch": 3, "seq": 13},
    {"batch": 4, "seq": 32},
)
IMAGE_SIZES = ({"batch": 1}, {"batch": 3}, {"batch": 4})


def _transformers():
    """transformers imports torchvision when Pillow is installed: make that import work first."""
    import_torchvision()
    import transformers

    return transformers


def _causal_lm(config_cls, model_cls, inputs=("input_ids",), **cfg) -> Callable[[], ModelSpec]:
    def spec() -> ModelSpec:
        transformers = _transformers()

        config = getattr(transformers, config_cls)(vocab_size=VOCAB, **cfg)
        batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
        return ModelSpec(
            module=lambda: trained_norms(getattr(transformers, model_cls)(config)),
            inputs=_tokens(*inputs, batch=batch, seq=seq),
            name=model_cls,
        )

    return spec


LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _bert(minilm: bool = False) -> ModelSpec:
    _transformers()
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=48 if minilm else 32,
        num_hidden_layers=2,
        num_attention_heads=4 if minilm else 2,
        intermediate_size=96 if minilm else 64,
        max_position_embeddings=64,
    )
    batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
    names = ("input_ids", "attention_mask") if minilm else ("input_ids", "attention_mask", "token_type_ids")

    def padded(sizes):  # rows of different lengths: the mask's zeros pad the shorter ones
        b, t = sizes["batch"], sizes["seq"]
        mask = torch.ones(b, t, dtype=torch.int64)
        for row in range(1, b):
            mask[row, max(1, t - row * 3) :] = 0
        return {"attention_mask": mask}

    return ModelSpec(
        module=lambda: trained_norms(BertModel(config)),
        inputs=_tokens(*names, batch=batch, seq=seq),
        name="MiniLM" if minilm else "BertModel",
        example_inputs=padded,
    )


def _t5() -> ModelSpec:
    _transformers()
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
    return ModelSpec(
        module=lambda: trained_norms(T5EncoderModel(config)),
        inputs=_tokens("input_ids", "attention_mask", batch=batch, seq=seq),
        name="T5EncoderModel",
    )


def _roberta() -> ModelSpec:
    """RoBERTa (and so XLM-R, CamemBERT): positions counted from the padding (a cumsum over the
    sequence of ``input_ids != pad``), token types gathered from a buffered zeros by them."""
    _transformers()
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,  # the positions start after the pad id: seq + 2 of them
        pad_token_id=1,
    )
    batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
    return ModelSpec(
        module=lambda: trained_norms(RobertaModel(config)),
        inputs=_tokens("input_ids", "attention_mask", batch=batch, seq=seq),
        name="RobertaModel",
    )


def _deberta_v2() -> ModelSpec:
    """DeBERTa-v2/v3: disentangled attention over log-bucketed relative positions (``sign``, a log
    and a ceil of the distances over a symbolic sequence), the position embeddings LayerNorm'd."""
    _transformers()
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=16,
        max_relative_positions=64,
        pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm",
        share_att_key=True,
    )
    batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
    return ModelSpec(
        module=lambda: trained_norms(DebertaV2Model(config)),
        inputs=_tokens("input_ids", "attention_mask", batch=batch, seq=seq),
        name="DebertaV2Model",
    )


def _vit() -> ModelSpec:
    _transformers()
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    return ModelSpec(
        module=lambda: trained_norms(ViTForImageClassification(config)),
        inputs=[Input("pixel_values", (Dim("batch", 1, 4), 3, 32, 32))],
        name="ViTForImageClassification",
    )


def _whisper() -> ModelSpec:
    _transformers()
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        num_mel_bins=16,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        max_source_positions=24,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    # the encoder takes 2 * max_source_positions mel frames, no other length
    return ModelSpec(
        module=lambda: trained_norms(WhisperEncoder(config)),
        inputs=[Input("input_features", (Dim("batch", 1, 4), 16, 48))],
        name="WhisperEncoder",
    )


def _audio(config: str, model: str, **extra) -> Callable[[], ModelSpec]:
    """An audio encoder over raw audio of a symbolic length (wav2vec 2.0's family): its feature
    convolutions (1-D, strided, the first GroupNorm'd) make a frame count of floor divisions of the
    samples, then a grouped positional convolution over the frames (weight norm), then the
    transformer layers. SEW (``squeeze_factor``) pools the frames by 2 before the layers and pads
    them back after: a 1-D average pool over a symbolic length, a pad of 0 or 1 by its parity."""

    def spec() -> ModelSpec:
        _transformers()
        import transformers

        cfg = getattr(transformers, config)(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            conv_dim=(16, 16, 16),
            conv_stride=(5, 2, 2),
            conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            vocab_size=VOCAB,
            **extra,
        )
        return ModelSpec(
            module=lambda: trained_norms(getattr(transformers, model)(cfg)),
            inputs=[Input("input_values", (Dim("batch", 1, 4), Dim("samples", 400, 431)))],
            name=model,
        )

    return spec


AUDIO_SIZES = ({"batch": 1, "samples": 400}, {"batch": 3, "samples": 417}, {"batch": 4, "samples": 431})


def trained_norms(module: torch.nn.Module) -> torch.nn.Module:
    """Trained-looking normalization layers (LayerNorm, RMSNorm, GroupNorm, ... but BatchNorm,
    ``lively``'s): scales moved from their initial values (1, or 0 where the norm multiplies by
    ``1 + weight``) by up to 0.5 either way and shifts of about 0.1, seeded, as after training.

    Freshly built models initialize them to scale 1 and shift 0, where the build's fold of a norm's
    scale and shift into the projections after it (``tracer/norm_scales.py``) changes no value: a
    fold that read them wrongly would still match eager. Like loading a checkpoint, this changes
    values only, never the architecture."""
    if any(p.is_meta for p in module.parameters()):  # shapes-only builds
        return module
    gen = torch.Generator().manual_seed(0)  # at seed 0 no tiny decoder of tests/hf repeats one token
    with torch.no_grad():
        for m in module.modules():
            weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
            if (
                "Norm" not in type(m).__name__
                or isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                or not isinstance(weight, torch.nn.Parameter)
                or weight.dim() != 1
            ):
                continue
            weight.add_(torch.rand(weight.shape, generator=gen) - 0.5)  # Gemma's zero-centered ones too
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return module


def lively(module: torch.nn.Module, size: int = 64) -> torch.nn.Module:
    """Trained-looking BatchNorm for a freshly built vision model: random affine parameters, and
    running statistics measured on random ``size`` x ``size`` images, as after training (its other
    norms first, ``trained_norms``).

    At initialization these networks are nearly degenerate in eval mode: zero-initialized last
    BatchNorm of each residual block, and unit statistics that do not match the activations, so
    torchvision's efficientnet_b0 outputs ~1e-13; with random statistics instead, what the input
    contributes still shrinks ~30x per stage and every image gives the same logits to 1e-7. A
    comparison with eager proves nothing then (``test_outputs_depend_on_the_inputs`` checks).
    Like loading a checkpoint, this changes values only, never the architecture."""
    module = trained_norms(module)  # first: the statistics below are measured through them
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms or any(p.is_meta for p in module.parameters()):  # shapes-only builds: nothing to measure
        return module
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.reset_running_stats()
        module.eval()  # dropout and stochastic depth off; BatchNorm alone measures
        momenta = [m.momentum for m in norms]
        for m in norms:
            m.momentum = None  # a plain average over the calibration batch
            m.train()
        module(torch.rand(8, 3, size, size, generator=gen) * 2 - 1)
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
    return module.eval()


def timm_model(name: str, size: int, **kwargs) -> torch.nn.Module:
    """timm's ``name``, unmodified, with random weights and BatchNorm calibrated on ``size`` x
    ``size`` images (``lively``); ``kwargs`` go to ``timm.create_model``."""
    import_torchvision()  # timm imports torchvision; on a CPU torch only through this
    import timm

    return lively(timm.create_model(name, pretrained=False, **kwargs), size)


def _timm(name: str, **kwargs) -> Callable[[], ModelSpec]:
    def spec() -> ModelSpec:
        import_torchvision()

        model_kwargs = {k: v for k, v in kwargs.items() if k != "img"}  # kwargs is shared by every call
        size = kwargs.get("img", 64)
        return ModelSpec(
            module=lambda: timm_model(name, size, num_classes=10, **model_kwargs),
            inputs=[Input("x", (Dim("batch", 1, 4), 3, size, size))],
            name=f"timm-{name}",
        )

    return spec


def _torchvision(name: str, size: int = 64) -> Callable[[], ModelSpec]:
    def spec() -> ModelSpec:
        tv = import_torchvision()
        return ModelSpec(
            module=lambda: lively(getattr(tv.models, name)(num_classes=10), size),
            inputs=[Input("x", (Dim("batch", 1, 4), 3, size, size))],
            name=f"torchvision-{name}",
        )

    return spec


ZOO: dict[str, Case] = {
    "gpt2": Case(
        _causal_lm(
            "GPT2Config",
            "GPT2LMHeadModel",
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
        TEXT_SIZES,
        "transformers",
    ),
    "llama": Case(_causal_lm("LlamaConfig", "LlamaForCausalLM", **LLAMA), TEXT_SIZES, "transformers"),
    "qwen2": Case(_causal_lm("Qwen2Config", "Qwen2ForCausalLM", **LLAMA), TEXT_SIZES, "transformers"),
    "mistral": Case(_causal_lm("MistralConfig", "MistralForCausalLM", **LLAMA), TEXT_SIZES, "transformers"),
    # batched prefill: the mask reads a user input, so the build must keep it (traced with all ones)
    "llama-attention_mask": Case(
        _causal_lm("LlamaConfig", "LlamaForCausalLM", ("input_ids", "attention_mask"), **LLAMA),
        TEXT_SIZES,
        "transformers",
    ),
    "bert": Case(_bert, TEXT_SIZES, "transformers"),
    "minilm": Case(lambda: _bert(minilm=True), TEXT_SIZES, "transformers"),
    "roberta": Case(_roberta, TEXT_SIZES, "transformers"),
    "deberta-v2": Case(_deberta_v2, TEXT_SIZES, "transformers"),
    "t5-encoder": Case(_t5, TEXT_SIZES, "transformers"),
    "vit": Case(_vit, IMAGE_SIZES, "transformers"),
    "whisper-encoder": Case(_whisper, IMAGE_SIZES, "transformers"),
    "wav2vec2": Case(_audio("Wav2Vec2Config", "Wav2Vec2Model"), AUDIO_SIZES, "transformers"),
    "sew": Case(_audio("SEWConfig", "SEWModel", squeeze_factor=2), AUDIO_SIZES, "transformers"),
    # SEW's squeeze with DeBERTa-v2's attention over log-bucketed relative positions
    "sew-d": Case(_audio("SEWDConfig", "SEWDModel", squeeze_factor=2), AUDIO_SIZES, "transformers"),
    "timm-resnet50": Case(_timm("resnet50"), IMAGE_SIZES, "timm"),
    "timm-convnext_tiny": Case(_timm("convnext_tiny"), IMAGE_SIZES, "timm"),
    "timm-vit_small": Case(
        _timm("vit_small_patch16_224", img=32, img_size=32, patch_size=8), IMAGE_SIZES, "timm"
    ),
    # weight-standardized convolutions: a batch norm over each weight's own statistics, in eval mode
    "timm-nf_resnet26": Case(_timm("nf_resnet26"), IMAGE_SIZES, "timm"),
    "torchvision-mobilenet_v3_small": Case(_torchvision("mobilenet_v3_small"), IMAGE_SIZES, "torchvision"),
    "torchvision-efficientnet_b0": Case(_torchvision("efficientnet_b0"), IMAGE_SIZES, "torchvision"),
}
