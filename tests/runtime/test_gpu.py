"""The runtime on a GPU beside the torch loader, on the same library-free bundle: inputs from torch
through DLPack (device) and from NumPy (host), outputs through DLPack into torch and as NumPy,
equal bit for bit to the torch loader's GPU outputs (the same cubins run: the same plan, a tuned
one where the bundle's table chose forms); CUDA-graph replay at a bucket and launch by launch off
the buckets; outputs the caller owns. ``AOTPACK_RT_BUNDLES``:
more library-free bundles to compare (``path:sym=n,...`` separated by spaces)."""

from __future__ import annotations

import os

import pytest

from tests.runtime.test_torch_free import pointwise  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu


def _compare(path, sizes: dict[str, int]):
    import numpy as np
    import torch

    import aot.runtime
    from aot.loader import load

    rt = aot.runtime.load(path)
    ref = load(path, device="cuda")
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for name, _, dtype, dims in rt.checked.entries[0].guards.inputs:
        shape = [d if type(d) is int else sizes[d] for d in dims]
        t = (
            torch.randint(0, 50257, shape, generator=gen)
            if dtype.startswith("int")
            else torch.randn(shape, generator=gen)
        )
        inputs[name] = t.to(getattr(torch, dtype)).cuda()
    want = ref(**inputs)
    got = rt(**inputs)  # torch CUDA tensors in through DLPack
    assert torch.equal(torch.from_dlpack(got), want)
    assert_same_plan(rt, ref, sizes)
    host = rt.run((), {k: v.cpu().numpy() for k, v in inputs.items()}, numpy=True)
    np.testing.assert_array_equal(host, want.cpu().numpy())
    again = rt(**inputs)
    assert again.ptr != got.ptr  # a later call never overwrites an earlier call's output
    assert torch.equal(torch.from_dlpack(got), want)


def assert_same_plan(rt, ref, sizes: dict[str, int]) -> None:
    """The steps the runtime ran at ``sizes`` are those the torch loader runs there (its bucket's
    tuned plan where the bundle's table chose forms, ``ProgramExecutor.plan_at``)."""
    from dataclasses import replace

    from aot.program import live_steps

    ours = [p for key, p in rt._prepared.items() if dict(key[1:]) == sizes]
    assert len(ours) == 1, list(rt._prepared)
    (prepared,) = ours
    (executor,) = [e for e in ref.executors if e.name == prepared.entry.name]
    theirs, _ = executor.plan_at(sizes)
    assert prepared.steps == live_steps(replace(executor.program, steps=theirs))


@pytest.mark.parametrize("batch", [8, 5])  # a bucket (graph) and no bucket (launch by launch)
def test_the_runtime_equals_the_torch_loader_on_the_gpu(pointwise, batch):  # noqa: F811
    _compare(pointwise, {"batch": batch})


def test_more_bundles_equal_the_torch_loader():
    for item in os.environ.get("AOTPACK_RT_BUNDLES", "").split():
        path, _, text = item.partition(":")
        _compare(path, {k: int(v) for k, v in (p.split("=") for p in text.split(",") if p)})


def test_the_arena_grows_for_a_larger_call_and_every_size_stays_right(pointwise):  # noqa: F811
    import numpy as np
    import torch

    import aot.runtime
    from aot.loader import load

    rt, ref = aot.runtime.load(pointwise), load(pointwise, device="cuda")
    sizes = []
    for batch in (1, 8, 16, 3, 8):  # 16 needs more than 1 and 8 did: plans and graphs made again
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch)).cuda()
        np.testing.assert_array_equal(rt.run((), {"x": x}, numpy=True), ref(x=x).cpu().numpy())
        sizes.append(rt.arena_bytes)
    assert sizes[0] < sizes[2] == sizes[-1]


def test_the_load_command_answers_without_importing_numpy(pointwise):  # noqa: F811
    """``aotpack-rt load`` in a fresh interpreter where torch is blocked: its zero inputs are made
    on the device and its first answer read back as bytes, so numpy is never imported (~0.1 s of
    the cold start); the report says when the first answer came."""
    from tests.runtime.test_torch_free import run_torch_free

    out = run_torch_free(
        f"""
        import contextlib, io, json
        from aot.runtime.cli import main
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["load", {str(pointwise)!r}, "--sizes", "batch=8", "--json"])
        report = json.loads(printed.getvalue())
        print(json.dumps({{"code": code, "numpy": "numpy" in sys.modules, "first": report["first_result_s"]}}))
        """
    )
    assert out["code"] == 0 and not out["numpy"] and out["first"] > 0


def test_weights_in_chunks_stream_on_several_threads_on_the_gpu(pointwise, monkeypatch, tmp_path):  # noqa: F811
    """The weights with a sha256 per 40-byte chunk, read, copied and hashed on three threads through
    the driver (each binding the context, an event per staging buffer): the outputs equal the
    torch loader's; a byte flipped in the last chunk is refused."""
    import torch

    import aot.runtime
    from aot import digests
    from aot.errors import BundleError
    from aot.loader import load
    from aot.runtime import weights as rt_weights
    from tests.hostile_util import read_entries, with_chunk_digests, with_member, write_entries

    monkeypatch.setattr(digests, "MIN_CHUNK_BYTES", 16)
    monkeypatch.setattr(rt_weights, "WEIGHT_THREADS", 3)
    monkeypatch.setattr(rt_weights, "STAGING_BYTES", 24)
    entries = with_chunk_digests(read_entries(pointwise.read_bytes()), 40)
    path = tmp_path / "chunked.tpk"
    path.write_bytes(write_entries(entries))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).cuda()
    got = aot.runtime.load(path)(x=x)
    assert torch.equal(torch.from_dlpack(got), load(pointwise, device="cuda")(x=x))
    weights = bytearray(next(e.data for e in entries if e.name == "weights.safetensors"))
    weights[-1] ^= 0x01
    path.write_bytes(write_entries(with_member(entries, "weights.safetensors", bytes(weights), resign=False)))
    with pytest.raises(BundleError, match=r"checksum mismatch in 'weights.safetensors' \(chunk "):
        aot.runtime.load(path)


def test_inputs_at_a_pitch_and_raw_bytes_equal_dense_inputs_on_the_gpu(pointwise):  # noqa: F811
    """A slice of wider rows on the device and on the host (one 2-D copy each), a ``memoryview``
    and raw bytes with a dtype (``runner.array``): outputs equal the dense input's, bit for bit."""
    import torch

    import aot.runtime

    rt = aot.runtime.load(pointwise)
    wide = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    dense = wide[:, 5:21].contiguous()
    want = torch.from_dlpack(rt(x=dense.cuda())).cpu()
    assert torch.equal(torch.from_dlpack(rt(x=wide.cuda()[:, 5:21])).cpu(), want)
    assert torch.equal(torch.from_dlpack(rt(x=wide.numpy()[:, 5:21])).cpu(), want)
    raw = dense.numpy().tobytes()
    assert torch.equal(torch.from_dlpack(rt(x=memoryview(raw).cast("f", [8, 16]))).cpu(), want)
    assert torch.equal(torch.from_dlpack(rt(x=rt.array(raw, "float32", [8, 16]))).cpu(), want)
