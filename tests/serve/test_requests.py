"""What a serving request must be before anything allocates for it (no server): declared shapes
against the guards with the runner's own text, data against the shapes, and the metrics text the
front rewrites to count refusals."""

from __future__ import annotations

import json

import pytest

from aot.errors import GuardError
from aot.serve.front import Refused, count_refused
from aot.serve.requests import RequestCheck, parse_kserve


@pytest.fixture(scope="module")
def check(bundles):
    from aot.loader import open_bundle

    opened = open_bundle(bundles("branchy"))  # x: float32[batch, seq, 16], seq even and >= 10
    try:
        return RequestCheck(opened.manifest.guards)
    finally:
        opened.close()


def body(shape, data, datatype="FP32", **extra) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": data, **extra}]}
    ).encode()


@pytest.mark.parametrize(
    "raw, error",
    [
        (
            b"{not json",
            "the request body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (b"[1, 2]", 'expected a KServe v2 body {"inputs": [{"name", "shape", "datatype", "data"}]}'),
        (body([2, 16, 16], [0.5] * 10), "input 'x': data holds 10 values, shape [2, 16, 16] needs 512"),
        (
            body([1, 2**40, 16], [0.5] * 32),
            "input 'x' dim 1 (seq): expected 10 <= seq <= 256, seq % 2 == 0, got 1099511627776 (declared in the model file)",
        ),
        (
            body([1, 2**62, 16], [0.5] * 32),
            "input 'x' dim 1 (seq): expected 10 <= seq <= 256, seq % 2 == 0, got 4611686018427387904 (declared in the model file)",
        ),
        (
            body([17, 10, 16], [0.5] * 2720),
            "input 'x' dim 0 (batch): expected 1 <= batch <= 16, got 17 (declared in the model file)",
        ),
        (body([1, 16], [0.5] * 16), "input 'x': expected rank 3 [batch, seq, 16], got rank 2 [1, 16]"),
        (body([1, 10, 15], [0.5] * 150), "input 'x' dim 2: expected static size 16, got 15"),
        (body([1, 10, 16], [0.5] * 160, "FP16"), "input 'x': expected datatype FP32, got FP16"),
        (body([1, 10, 16], [[0.5] * 16] * 10), None),  # nested data is fine
        (
            body([1, 10, 16], None, parameters={"binary_data_size": 640}),
            "the request carries 0 bytes of binary data, its inputs declare 640",
        ),
    ],
)
def test_requests_are_checked_before_anything_allocates(check, raw, error):
    if error is None:
        check.kserve(*parse_kserve(raw))
        return
    with pytest.raises(GuardError) as caught:
        check.kserve(*parse_kserve(raw))
    assert str(caught.value) == error


def test_a_binary_request_is_checked_by_its_header(check):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 10, 16],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 640},
                }
            ]
        }
    ).encode()
    check.kserve(*parse_kserve(header + bytes(640), len(header)))
    with pytest.raises(GuardError, match="carries 639 bytes of binary data, its inputs declare 640"):
        check.kserve(*parse_kserve(header + bytes(639), len(header)))


def test_refusals_are_counted_as_failures_in_the_metrics():
    text = (
        'nv_inference_request_success{model="m",version="1"} 7\n'
        'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1\n'
        'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 2\n'
        'nv_inference_request_failure{model="other",reason="REJECTED",version="1"} 0\n'
    )
    refused = Refused()
    for by_model in (False, False, False, True):
        refused.add(by_model)
    assert count_refused(text, "m", refused) == (
        'nv_inference_request_success{model="m",version="1"} 6\n'
        'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1\n'
        'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 6\n'
        'nv_inference_request_failure{model="other",reason="REJECTED",version="1"} 0\n'
    )
