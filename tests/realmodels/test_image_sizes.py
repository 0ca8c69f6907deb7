"""Vision models from transformers with height and width declared dynamic, built unmodified and
compared with eager at the minimum, an odd (admitted) and the maximum size.

- Swin (windows, padding to whole patches and windows, 2x2 patch merging) declares
  ``multiple_of=8``; declared without it, the build fails naming the multiple, the Dim and the
  model lines.
- MobileViT turns its unfolded map size into a Python int (``int(math.ceil(h / 2) * 2)``), which
  fixes each size per trace: ``multiple_of=32`` leaves one program per admitted size.
- SegFormer (overlapping strided patch embeddings, spatial-reduction attention) declares
  ``multiple_of=32``, so no stage's map is odd; its 1x1 last stage at 32 gets its own program.
- DINOv2 interpolates its position embeddings with a scale computed from the sizes
  (``4 / (height // 7)``), stored as a float expression and evaluated per call; no multiple. At
  its native patch grid it uses them as they are (``num_patches == num_positions and height ==
  width``): the general trace's relation ``(height//7)*(width//7) != 16`` excludes those sizes, so
  the build traces them as programs of their own (at 28x28 beside 14..56, and at 224x224 beside
  112..336 for a 224 config).

Tolerance (float32): max |bundle - eager| <= 1e-4 * max(1, max |eager|) per output, as the zoo's
(``tests/realmodels/test_realmodels.py``): the CPU path runs eager's ATen ops.
"""

from __future__ import annotations

import dataclasses

import pytest

from aot import Dim, Input, ModelSpec
from aot.errors import TraceError
from tests.realmodels.conftest import require
from tests.realmodels.test_realmodels import difference, eager
from tests.realmodels.zoo import _transformers

pytestmark = pytest.mark.slow  # four transformers vision models, several programs each: minutes


def _image(model_cls, config, height: Dim, width: Dim, batch: int = 3, **kwargs):
    def spec() -> ModelSpec:
        transformers = _transformers()
        cfg = getattr(transformers, config[0])(**config[1])
        return ModelSpec(
            module=lambda: getattr(transformers, model_cls)(cfg),
            inputs=[Input("pixel_values", (Dim("batch", 1, batch), 3, height, width))],
            name=model_cls,
            kwargs=kwargs,
        )

    return spec


SWIN = (
    "SwinConfig",
    dict(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=2,
        mlp_ratio=2.0,
    ),
)
CASES = {
    "swin": (
        _image("SwinModel", SWIN, Dim("height", 16, 64, multiple_of=8), Dim("width", 16, 64, multiple_of=8)),
        (
            {"batch": 1, "height": 16, "width": 16},
            {"batch": 2, "height": 24, "width": 40},
            {"batch": 3, "height": 64, "width": 64},
        ),
    ),
    "mobilevit": (
        _image(
            "MobileViTModel",
            (
                "MobileViTConfig",
                dict(
                    image_size=32,
                    patch_size=2,
                    hidden_sizes=[16, 16, 16],
                    neck_hidden_sizes=[8, 8, 16, 16, 16, 24, 32],
                    num_attention_heads=2,
                    mlp_ratio=2.0,
                    expand_ratio=2.0,
                ),
            ),
            Dim("height", 32, 96, multiple_of=32),
            Dim("width", 32, 64, multiple_of=32),
        ),
        (
            {"batch": 1, "height": 32, "width": 32},
            {"batch": 2, "height": 96, "width": 32},
            {"batch": 3, "height": 96, "width": 64},
        ),
    ),
    "segformer": (
        _image(
            "SegformerForSemanticSegmentation",
            (
                "SegformerConfig",
                dict(
                    num_encoder_blocks=4,
                    depths=[1, 1, 1, 1],
                    sr_ratios=[8, 4, 2, 1],
                    hidden_sizes=[8, 16, 24, 32],
                    patch_sizes=[7, 3, 3, 3],
                    strides=[4, 2, 2, 2],
                    num_attention_heads=[1, 1, 2, 2],
                    mlp_ratios=[2, 2, 2, 2],
                    decoder_hidden_size=16,
                    num_labels=3,
                ),
            ),
            Dim("height", 32, 128, multiple_of=32, example=96),
            Dim("width", 32, 128, multiple_of=32, example=96),
        ),
        (
            {"batch": 1, "height": 32, "width": 32},
            {"batch": 3, "height": 96, "width": 64},
            {"batch": 3, "height": 128, "width": 128},
        ),
    ),
    "dinov2": (
        _image(
            "Dinov2Model",
            (
                "Dinov2Config",
                dict(
                    image_size=28,
                    patch_size=7,
                    hidden_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=64,
                ),
            ),
            Dim("height", 14, 56),
            Dim("width", 14, 56),
        ),
        (
            {"batch": 1, "height": 14, "width": 14},
            {"batch": 2, "height": 23, "width": 41},
            {"batch": 1, "height": 28, "width": 28},  # the native 4x4 grid: the embedding as it is
            {"batch": 2, "height": 14, "width": 56},  # 2x8 patches: as many as the native grid
            {"batch": 2, "height": 30, "width": 33},
            {"batch": 3, "height": 56, "width": 56},
        ),
    ),
    "dinov2-224": (  # native 224x224 (16x16 patches of 14), declared around it
        _image(
            "Dinov2Model",
            (
                "Dinov2Config",
                dict(
                    image_size=224,
                    patch_size=14,
                    hidden_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=64,
                ),
            ),
            Dim("height", 112, 336),
            Dim("width", 112, 336),
            batch=2,
        ),
        (
            {"batch": 1, "height": 224, "width": 224},
            {"batch": 2, "height": 237, "width": 237},
            {"batch": 1, "height": 224, "width": 230},
            {"batch": 1, "height": 112, "width": 112},
            {"batch": 2, "height": 161, "width": 303},
            {"batch": 2, "height": 336, "width": 336},
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dynamic_image_sizes_match_eager(zoo_build, name):
    require("transformers")
    make, sizes = CASES[name]
    b = zoo_build(f"image-sizes-{name}", make).ok()
    from aot.tracer import example_inputs

    for s in sizes:
        inputs = example_inputs(b.spec, s, seed=sum(s.values()))
        want = eager(b.spec, b.module, inputs)
        got = b.runner(**inputs)
        assert (why := difference(got, want)) is None, f"{name} at {s}: {why}"
    declared = {d.name: d.multiple_of for d in b.spec.dims()}
    for g in b.runner.manifest.guards.symbols:  # nothing declared is lost, the multiple is recorded
        assert g.declared_multiple == (declared[g.name] if declared[g.name] > 1 else 0), g
        assert (g.min, g.max, g.modulus, g.excluded) == (
            g.declared_min,
            g.declared_max,
            declared[g.name],
            (),
        ), g
    assert not b.runner.manifest.guards.relations  # the programs together admit every declared size


def test_dinov2_stores_its_interpolation_scale_as_a_float_of_the_sizes(zoo_build):
    require("transformers")
    from aot.schema import SymFloat

    b = zoo_build("image-sizes-dinov2", CASES["dinov2"][0]).ok()
    steps, floats = list(b.runner.program.steps), []
    while steps:  # the program's steps and the reference decompositions of its kernels
        step = steps.pop()
        steps += step.reference
        floats += [a.text for a in [*step.args, *step.kwargs.values()] if isinstance(a, SymFloat)]
    assert any("height//7" in f for f in floats) and any("width//7" in f for f in floats), floats


def test_swin_without_the_multiple_fails_naming_it_and_the_model_lines():
    require("transformers")
    from aot.tracer import trace

    spec = CASES["swin"][0]()
    plain = [
        dataclasses.replace(
            i, shape=tuple(Dim(s.name, s.min, s.max) if isinstance(s, Dim) else s for s in i.shape)
        )
        for i in spec.inputs
    ]
    with pytest.raises(TraceError) as e:
        trace(dataclasses.replace(spec, inputs=plain))
    msg = str(e.value)
    assert (
        "the model needs height to be a multiple of 8: declare Dim('height', 16, 64, multiple_of=8)" in msg
    ), msg
    assert (
        "the model needs width to be a multiple of 8: declare Dim('width', 16, 64, multiple_of=8)" in msg
    ), msg
    assert "transformers/models/swin/modeling_swin.py:272: if height % self.patch_size[0] != 0:" in msg, msg


def _timm_any_size(name: str) -> ModelSpec:
    from tests.realmodels.zoo import timm_model

    return ModelSpec(
        module=lambda: timm_model(name, 48, num_classes=10),
        inputs=[Input("x", (Dim("batch", 1, 2), 3, Dim("height", 32, 64), Dim("width", 32, 64)))],
        name=f"timm-{name}",
    )


def _detr() -> ModelSpec:
    """DETR with a small ResNet of transformers' own as its backbone, at declared image sizes."""

    def make():
        transformers = _transformers()
        backbone = transformers.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], out_features=["stage4"]
        )
        config = transformers.DetrConfig(
            use_timm_backbone=False,
            use_pretrained_backbone=False,
            backbone_config=backbone,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_queries=5,
            num_labels=3,
        )
        return transformers.DetrForObjectDetection(config)

    size = dict(multiple_of=32)
    return ModelSpec(
        module=make,
        inputs=[
            Input(
                "pixel_values",
                (Dim("batch", 1, 2), 3, Dim("height", 64, 128, **size), Dim("width", 64, 128, **size)),
            )
        ],
        name="detr",
    )


# library-free at declared image sizes: the convolutions' and pools' maps symbolic (2026-12-05)
LIBRARY_FREE = {
    "swin": ("transformers", "CASES['swin'][0]()", CASES["swin"][1]),
    "timm-resnet26d": (  # a deep stem, its max pool, ResNet-D's average-pooled shortcuts
        "timm",
        "_timm_any_size('resnet26d')",
        ({"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 45, "width": 61}),
    ),
    "timm-mobilenetv3_small_050": (  # depthwise convolutions, squeeze-excitation, hard-swish
        "timm",
        "_timm_any_size('mobilenetv3_small_050')",
        ({"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 45, "width": 61}),
    ),
    "detr": (  # its pixel mask resized (nearest) to the features' map, sums of it along the map
        "transformers",
        "_detr()",
        ({"batch": 1, "height": 64, "width": 64}, {"batch": 2, "height": 96, "width": 128}),
    ),
    "dinov2": (  # its position embeddings resized bicubically to the patch grid (a gather kernel)
        "transformers",
        "CASES['dinov2'][0]()",
        (
            {"batch": 1, "height": 14, "width": 14},
            {"batch": 2, "height": 30, "width": 33},
            {"batch": 1, "height": 28, "width": 28},
            {"batch": 3, "height": 56, "width": 56},
        ),
    ),
}


@pytest.mark.parametrize("name", list(LIBRARY_FREE))
def test_library_free_builds_at_declared_image_sizes(tmp_path, name):
    """A vision model whose height and width are declared dynamic builds ``--library-free`` (what
    aotpack-rt runs without torch): every convolution and pool a kernel over a symbolic map. The
    CPU path equals eager at the sizes, and every kernel its reference in Triton's interpreter at
    the smallest size and an odd, unequal one."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import is_view, live_steps
    from aot.schema import StepKind
    from aot.tracer import example_inputs, instantiate, load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess
    from tests.realmodels.conftest import ROOT

    library, made, sizes = LIBRARY_FREE[name]
    require(library)
    model = tmp_path / f"{name.replace('-', '_')}.py"
    model.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.realmodels.test_image_sizes import CASES, _detr, _timm_any_size\n"
        f"spec = {made}\n"
    )
    spec = load_model_file(model)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    live = live_steps(compiled.program)
    assert all(s.kind == StepKind.KERNEL or is_view(s) for s in live), [s.target for s in live]
    pack(compiled, tmp_path / "model.tpk")
    runner, module = load(tmp_path / "model.tpk"), instantiate(spec)
    for s in sizes:
        inputs = example_inputs(spec, s, seed=sum(s.values()))
        assert (why := difference(runner(**inputs), eager(spec, module, inputs))) is None, (
            f"{name} at {s}: {why}"
        )
    (results,) = interpret_in_subprocess([(tmp_path / "model.tpk", model, list(sizes[:2]), 1)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in compiled.program.kernels}, size
        bad = [
            f"{c.name} {c.output}: {c.max_abs_error:.3g} ({c.worst_ratio:.2f}x)" for c in checks if not c.ok
        ]
        assert not bad, f"{name} at {size}: " + "; ".join(bad)


def _timm_vit() -> ModelSpec:
    """timm's ViT with ``dynamic_img_size``: its position embeddings resampled to the patch grid
    with an antialiased bicubic resize (``aten._upsample_bicubic2d_aa``)."""
    from tests.realmodels.zoo import timm_model

    size = dict(multiple_of=16)
    return ModelSpec(
        module=lambda: timm_model(
            "vit_tiny_patch16_224", 64, img_size=64, dynamic_img_size=True, num_classes=10
        ),
        inputs=[
            Input("x", (Dim("batch", 1, 3), 3, Dim("height", 32, 96, **size), Dim("width", 32, 96, **size)))
        ],
        name="timm-vit-dynamic",
    )


def test_timm_vit_resamples_its_position_embeddings_at_declared_sizes(zoo_build):
    require("timm")
    from aot.tracer import example_inputs

    b = zoo_build("image-sizes-timm-vit", _timm_vit).ok()
    for s in (
        {"batch": 1, "height": 32, "width": 32},
        {"batch": 2, "height": 48, "width": 96},
        {"batch": 3, "height": 96, "width": 96},
    ):
        inputs = example_inputs(b.spec, s, seed=sum(s.values()))
        assert (why := difference(b.runner(**inputs), eager(b.spec, b.module, inputs))) is None, (
            f"at {s}: {why}"
        )
    assert "aten._upsample_bicubic2d_aa.default" in {s.target for s in b.runner.program.steps}
