"""The serving contract read from the manifest, and Triton's config.pbtxt rendered from it (parsed
back with Triton's own ModelConfig protobuf)."""

from __future__ import annotations

import pytest

from aot.errors import EnvError
from aot.serve.config import check_stateless, open_spec, preferred_sizes, render_config


def parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_batched_bundle(bundles):
    spec = open_spec(bundles("branchy"))
    assert spec.name == "branchy" and spec.batch_symbol == "batch" and spec.max_batch_size == 16
    assert [(s.name, s.dtype, s.dims) for s in spec.inputs] == [("x", "float32", (-1, -1, 16))]
    assert [(s.name, s.dtype, s.dims) for s in spec.outputs] == [("output", "float32", (-1, -1, 16))]
    assert spec.buckets == (1, 2, 4, 8, 16) and spec.preferred_batch_sizes == (2, 4, 8, 16)
    config = parse(render_config(spec, {"bundle": "/b.tpk"}, "cpu", 500))
    assert config.name == "branchy" and config.backend == "python" and config.max_batch_size == 16
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", 11, [-1, 16])]  # TYPE_FP32
    assert [(o.name, list(o.dims)) for o in config.output] == [("output", [-1, 16])]
    assert list(config.dynamic_batching.preferred_batch_size) == [2, 4, 8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.instance_group[0].kind == 2  # KIND_CPU
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params == {"bundle": "/b.tpk", "device": "cpu"}


def test_unbatched_bundle_runs_request_by_request(bundles):
    """structured.py returns a scalar (h.sum()) beside its batched outputs: dim 0 is not the batch
    everywhere, so requests cannot be joined."""
    spec = open_spec(bundles("structured"))
    assert spec.batch_symbol == "" and spec.max_batch_size == 0
    assert [s.name for s in spec.inputs] == ["features", "mask"]
    assert [(s.name, s.dims) for s in spec.outputs] == [
        ("hidden", (-1, 4)),
        ("pair.low", (-1,)),
        ("pair.high", (-1,)),
        ("masked.0", (-1, 4)),
        ("extra.0", ()),
    ]
    config = parse(render_config(spec, {"bundle": "b.tpk"}, "cuda"))
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert [list(i.dims) for i in config.input] == [[-1, 4], [-1]]  # full shapes, batch dim included
    assert config.instance_group[0].kind == 1  # KIND_GPU


def test_fp16_bundle_and_name(bundles):
    spec = open_spec(bundles("small_mlp"), "mlp-v2")
    config = parse(render_config(spec, {"bundle": "b"}))
    assert config.name == "mlp-v2" and config.input[0].data_type == 10  # TYPE_FP16
    assert config.max_batch_size == 64 and list(config.dynamic_batching.preferred_batch_size) == [
        2, 4, 8, 16, 32, 64,
    ]  # fmt: skip


def test_preferred_sizes_leave_out_one_and_sizes_past_the_maximum():
    assert preferred_sizes((1, 2, 4, 8), 8) == (2, 4, 8)
    assert preferred_sizes((8, 1, 4, 16), 6) == (4,)
    assert preferred_sizes((), 8) == ()


def test_stateful_bundles_are_refused(built, bundles):
    from aot.loader.bundle import open_bundle

    stateful = open_bundle(built("tiny_lm", ("sm_90",)))  # the lm tests' build
    try:
        with pytest.raises(EnvError, match=r"stateful \(2 entry points\).*aotpack generate"):
            check_stateless(stateful.manifest, stateful.program())
    finally:
        stateful.close()
    stateless = open_bundle(bundles("branchy"))
    try:
        check_stateless(stateless.manifest, stateless.program())
    finally:
        stateless.close()


def test_bad_device_is_refused(bundles):
    with pytest.raises(EnvError, match="'cpu' or 'cuda'"):
        render_config(open_spec(bundles("branchy")), {}, "tpu")


def test_io_dtype_float32_carries_half_precision_as_float32(bundles):
    spec = open_spec(bundles("small_mlp"), io_dtype="float32")  # float16 in and out
    assert [(s.name, s.dtype) for s in (*spec.inputs, *spec.outputs)] == [
        ("x", "float32"),
        ("output", "float32"),
    ]
    config = parse(render_config(spec, {"bundle": "/b.tpk"}))
    assert [i.data_type for i in config.input] == [11] and [o.data_type for o in config.output] == [
        11
    ]  # FP32
    assert config.parameters["io_dtype"].string_value == "float32"
    plain = open_spec(bundles("small_mlp"))
    assert [s.dtype for s in (*plain.inputs, *plain.outputs)] == ["float16", "float16"]
    assert "io_dtype" not in parse(render_config(plain, {"bundle": "/b.tpk"})).parameters
    with pytest.raises(EnvError, match=r"io_dtype must be one of \['', 'float32'\], got 'int8'"):
        open_spec(bundles("small_mlp"), io_dtype="int8")
