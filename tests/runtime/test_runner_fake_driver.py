"""What the runtime enqueues on the driver, without a GPU: ``aot.runtime.runner.Runner`` over a
recording stand-in for ``aot.runtime.driver`` (device memory is plain host memory, so copies are
real and launches are recorded). Pins the weights' upload into one allocation, the arena's inputs
and outputs, each kernel's packed parameters (pointers into the arena and the weights, sizes, the
trailing scratch pointers) and grid, a CUDA graph captured once per bucket and replayed, and launch
by launch off the buckets. The GPU tests check the same runner's results (``test_gpu.py``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from aot.runtime import driver as drv
from aot.runtime.arrays import CUDA
from tests.codegen.test_cache_kernels import tiny_lm_free  # noqa: F401 - the fixture
from tests.runtime.test_torch_free import pointwise  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow  # builds the pointwise bundle (trace and compile)


class FakeKernel:
    def __init__(self, log, cubin, name, shared, num_warps, dependent=False):
        self.log, self.name, self.block, self.dependent = log, name, 32 * num_warps, dependent
        assert cubin[:4] == b"\x7fELF"  # the bundle's cubin, sha256 checked on read

    def launch(self, grid, stream, params):
        """Record the packed parameters; as the GPU would, run ``fused_mul_add_relu`` on them
        (out = relu(2 * x + shift), x [batch, 16]), so results show every pointer was right."""
        words = [
            ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64)).contents.value for i in range(len(params))
        ]
        self.log.append(("launch", self.name, grid, words))
        x_at, shift_at, out_at, batch = words[:4]
        batch = ctypes.c_int32(batch & 0xFFFFFFFF).value
        x = np.frombuffer(ctypes.string_at(x_at, batch * 64), np.float32).reshape(batch, 16)
        shift = np.frombuffer(ctypes.string_at(shift_at, 64), np.float32)
        out = np.maximum(0, x * 2 + shift).astype(np.float32)
        ctypes.memmove(out_at, out.ctypes.data, out.nbytes)


class FakeDevice:
    """Device memory is host memory (ctypes buffers): copies really copy."""

    ordinal, capability, driver_version, name = 0, (9, 0), 13000, "fake"
    dependent_launch = True
    stream = stream_handle = 7

    def __init__(self):
        self.log, self.buffers = [], {}

    def bind(self):
        pass

    def memory(self):
        return (1 << 30, 2 << 30)

    def alloc(self, nbytes):
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        self.buffers[ctypes.addressof(buf)] = buf
        self.log.append(("alloc", nbytes))
        return ctypes.addressof(buf)

    def take(self, nbytes):
        return self.alloc(nbytes), nbytes

    def free(self, ptr):
        self.buffers.pop(ptr, None)

    def give(self, ptr, size):
        self.free(ptr)

    def release_blocks(self):  # ``give`` frees at once: no block is kept
        pass

    def host_alloc(self, nbytes):  # page-locked host memory: the weights' staging buffers
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        self.buffers[ctypes.addressof(buf)] = buf
        self.log.append(("host_alloc", nbytes))
        return ctypes.addressof(buf)

    def free_host(self, ptr):
        self.buffers.pop(ptr, None)
        self.log.append(("free_host",))

    def to_device(self, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    to_host = to_host_async = copy = to_device

    def zero(self, dst, nbytes):
        ctypes.memset(dst, 0, nbytes)

    def copy_rows(self, dst, src, width, pitch, rows, from_host=False):
        self.log.append(("copy_rows", from_host))
        for r in range(rows):
            ctypes.memmove(dst + r * width, src + r * pitch, width)

    def synchronize(self):
        pass

    def event(self):
        return object()

    def record(self, event):
        pass

    def destroy_event(self, event):
        pass

    def wait(self, event, stream):
        pass

    def capture(self, launch):
        """Capture runs nothing on a GPU; here it records the launches, and a replay runs them."""
        self.log.append(("capture",))
        launch()
        return ("graph", launch)

    def replay(self, instance):
        self.log.append(("replay",))
        instance()


@pytest.fixture
def fake(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(drv, "Kernel", lambda *a: FakeKernel(device.log, *a))
    monkeypatch.setattr(drv, "destroy_graph", lambda *a: None)
    return device


def test_what_a_call_enqueues(pointwise, fake):  # noqa: F811
    from aot.runtime import check
    from aot.runtime.runner import Runner

    checked = check(pointwise)
    runner = Runner(checked, fake)
    (weight,) = runner.weight_offsets
    # one allocation for the weights (16 floats at a 256-byte offset), streamed through one staging
    # buffer (the weights are one chunk) of the data's size past the header (under STAGING_BYTES),
    # freed after
    data = checked.manifest.members["weights.safetensors"].size
    assert fake.log[0] == ("alloc", 256)
    assert fake.log[1] == ("host_alloc", fake.log[1][1]) and fake.log[1][1] < data
    assert fake.log[2:] == [("free_host",)]
    w = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(w, torch.linspace(-1, 1, 16).numpy())  # the model's shift, bit for bit

    def call(batch: int, shift: float = 0.0):
        fake.log.clear()
        x = np.arange(batch * 16, dtype=np.float32).reshape(batch, 16) - 60 + shift
        out = runner.run((), {"x": x})
        assert out.device == (CUDA, 0) and out.shape == (batch, 16) and out.dtype == "float32"
        np.testing.assert_array_equal(out.numpy(), np.maximum(0, x * 2 + w))
        return out, list(fake.log)

    (kernel,) = checked.entries[0].program.kernels
    first, log = call(8)  # a bucket: arena, capture (recording the launch), replay, the output's memory
    assert [e[0] for e in log] == ["alloc", "capture", "launch", "replay", "launch", "alloc"]
    layout = runner._prepared[("general", ("batch", 8))].layout
    (_, name, grid, words) = log[2]
    assert name == kernel.name and grid == (1, 1, 1)  # (16*8 + 255)//256
    assert words == [
        runner.arena + layout.offsets["x"],
        runner.weights_base,
        runner.arena + layout.offsets["relu"],
        8,  # s_batch
        *[0] * kernel.scratch_params,
    ]
    second, log = call(8, shift=0.5)  # new inputs into the same arena, the graph replayed
    assert [e[0] for e in log] == ["replay", "launch", "alloc"] and second.ptr != first.ptr
    np.testing.assert_array_equal(
        first.numpy(), np.maximum(0, (np.arange(128, dtype=np.float32).reshape(8, 16) - 60) * 2 + w)
    )
    _, log = call(16)  # larger than the arena: a new one, and a new graph
    assert [e[0] for e in log] == ["alloc", "capture", "launch", "replay", "launch", "alloc"]
    _, log = call(5)  # no bucket: launched one by one, in the arena sized for 16
    assert [e[0] for e in log] == ["launch", "alloc"] and log[0][3][3] == 5


def test_the_weights_stream_through_the_staging_buffers_and_are_checked(
    pointwise,  # noqa: F811
    fake,
    monkeypatch,
    tmp_path,
):
    """Buffers smaller than a weight: its bytes cross chunks and arrive whole; a bundle whose
    weights changed after they were packed is refused by their sha256 after the stream."""
    import zipfile

    from aot.errors import BundleError
    from aot.runtime import check
    from aot.runtime import weights as rt_weights
    from aot.runtime.runner import Runner

    monkeypatch.setattr(rt_weights, "STAGING_BYTES", 24)  # 6 floats: the 16-float weight takes 3 chunks
    runner = Runner(check(pointwise), fake)
    got = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(got, torch.linspace(-1, 1, 16).numpy())
    assert [e for e in fake.log if e[0] == "host_alloc"] == [("host_alloc", 24)]

    bad = tmp_path / "bad.tpk"
    data = bytearray(pointwise.read_bytes())
    with zipfile.ZipFile(pointwise) as zf:
        info = zf.getinfo("weights.safetensors")
    name_length, extra_length = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    last = info.header_offset + 30 + name_length + extra_length + info.compress_size - 1
    data[last] ^= 0x01  # the last weight's last byte
    bad.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"checksum mismatch in 'weights.safetensors'"):
        Runner(check(bad), fake)


@pytest.mark.parametrize("deflate", [False, True], ids=["stored", "deflated"])
def test_chunked_weights_stream_on_several_threads_and_a_flipped_byte_in_any_chunk_is_refused(
    pointwise,  # noqa: F811
    fake,
    monkeypatch,
    tmp_path,
    deflate,
):
    """Weights with a sha256 per chunk (40 bytes here; 16 MiB as packed): stored, three threads
    each read, copy and hash chunks through a staging buffer of their own, pieces smaller than a
    chunk; deflated, one thread reads them in order. A byte flipped in any chunk, the header's
    included, is refused with that chunk's checksum text."""
    from aot import digests
    from aot.errors import BundleError
    from aot.runtime import check
    from aot.runtime import weights as rt_weights
    from aot.runtime.runner import Runner
    from tests.hostile_util import read_entries, with_chunk_digests, with_member, write_entries

    monkeypatch.setattr(digests, "MIN_CHUNK_BYTES", 16)
    monkeypatch.setattr(rt_weights, "WEIGHT_THREADS", 3)
    monkeypatch.setattr(rt_weights, "STAGING_BYTES", 24)
    entries = with_chunk_digests(read_entries(pointwise.read_bytes()), 40, deflate)
    good = tmp_path / "chunked.tpk"
    good.write_bytes(write_entries(entries))
    checked = check(good)
    member = checked.manifest.members["weights.safetensors"]
    assert member.chunk_bytes == 40 and len(member.chunk_sha256) > 3
    runner = Runner(checked, fake)
    got = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(got, torch.linspace(-1, 1, 16).numpy())
    assert [e for e in fake.log if e[0] == "host_alloc"] == [("host_alloc", 24)] * (1 if deflate else 3)

    weights = next(e.data for e in entries if e.name == "weights.safetensors")
    count = len(member.chunk_sha256)
    for index, (begin, end, want) in enumerate(digests.spans(member)):
        flipped = bytearray(weights)
        flipped[(begin + end) // 2] ^= 0x04
        bad = tmp_path / f"bad{index}.tpk"
        bad.write_bytes(
            write_entries(with_member(entries, "weights.safetensors", bytes(flipped), resign=False))
        )
        with pytest.raises(BundleError) as e:
            Runner(check(bad), fake)
        assert str(e.value) == (
            f"{bad}: checksum mismatch in 'weights.safetensors' (chunk {index + 1} of {count}, bytes "
            f"{begin}..{end}, expected sha256 {want[:16]}…): the bundle is corrupt or truncated: "
            f"rebuild or re-copy it"
        )


def test_weights_with_one_sha256_as_before_schema_1_11_still_load(pointwise, fake, tmp_path):  # noqa: F811
    """A bundle of schema 1.10 (the weights' one sha256, no chunk digests) loads, its weights
    checked whole; one of its bytes flipped is refused with the text it always had."""
    from aot.errors import BundleError
    from aot.runtime import check
    from aot.runtime.runner import Runner
    from tests.hostile_util import (
        manifest_bytes,
        manifest_of,
        read_entries,
        with_manifest_text,
        with_member,
        write_entries,
    )

    entries = read_entries(pointwise.read_bytes())
    manifest = manifest_of(entries)
    assert "chunk_sha256" not in manifest["members"]["weights.safetensors"]  # under one chunk
    old = with_manifest_text(entries, manifest_bytes({**manifest, "schema_version": [1, 10]}))
    path = tmp_path / "old.tpk"
    path.write_bytes(write_entries(old))
    runner = Runner(check(path), fake)
    got = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(got, torch.linspace(-1, 1, 16).numpy())
    weights = bytearray(next(e.data for e in old if e.name == "weights.safetensors"))
    weights[len(weights) // 3] ^= 0x10  # in the header
    path.write_bytes(write_entries(with_member(old, "weights.safetensors", bytes(weights), resign=False)))
    with pytest.raises(BundleError, match=r"checksum mismatch in 'weights.safetensors' \(expected sha256 "):
        Runner(check(path), fake)


def test_split_weights_stream_from_their_own_file(fake, monkeypatch, tmp_path):
    """A bundle packed with ``split_weights`` and chunk digests (the packager's, at a chunk size
    made small): the weights stream from the file beside it on several threads; a byte flipped
    there is refused."""
    from aot import digests
    from aot.codegen import generate
    from aot.errors import BundleError
    from aot.packager import pack
    from aot.runtime import check
    from aot.runtime import weights as rt_weights
    from aot.runtime.runner import Runner
    from aot.tracer import load_model_file, trace
    from tests.runtime.test_torch_free import HERE

    monkeypatch.setattr(digests, "CHUNK_BYTES", 32)
    monkeypatch.setattr(digests, "MIN_CHUNK_BYTES", 16)
    monkeypatch.setattr(rt_weights, "WEIGHT_THREADS", 2)
    out = tmp_path / "split.tpk"
    pack(generate(trace(load_model_file(HERE / "pointwise.py")), ("sm_90",)), out, split_weights=True)
    (split,) = [p for p in tmp_path.iterdir() if p.name.endswith(".safetensors")]
    checked = check(out)
    member = checked.manifest.members["weights.safetensors"]
    assert member.chunk_bytes == 32 and len(member.chunk_sha256) == -(-member.size // 32)
    runner = Runner(checked, fake)
    got = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(got, torch.linspace(-1, 1, 16).numpy())
    assert [e for e in fake.log if e[0] == "host_alloc"] == [("host_alloc", fake.log[1][1])] * 2
    data = bytearray(split.read_bytes())
    data[-1] ^= 0x01
    split.write_bytes(bytes(data))
    count = len(member.chunk_sha256)
    with pytest.raises(
        BundleError, match=rf"checksum mismatch in 'weights.safetensors' \(chunk {count} of {count},"
    ):
        Runner(check(out), fake)


def test_an_id_past_the_table_is_refused_before_anything_runs_as_by_the_torch_loader(tiny_lm_free, fake):  # noqa: F811
    """tests/data/tiny_lm.py built ``--library-free``: the runtime finds the inputs that index a
    weight's rows as the torch loader does (``aot.values``) and refuses a token id past the
    vocabulary, or a position past the table, with the torch loader's text, launching nothing."""
    from aot.errors import GuardError
    from aot.loader import load
    from aot.runtime import check
    from aot.runtime.runner import Runner

    free, _ = tiny_lm_free
    checked = check(free)
    cpu = load(free)
    for entry, ours in zip(cpu._entries, checked.entries):
        assert ours.value_bounds == entry.value_bounds and ours.value_bounds
    runner = Runner(checked, fake)
    ids = np.array([[5, 7, 11, 2]])
    mask = np.zeros((1, 32), np.int64)
    mask[:, :4] = 1
    good = dict(
        input_ids=ids,
        position_ids=np.arange(4)[None],
        cache_position=np.arange(4),
        attention_mask=mask,
    )
    for name, bad in (("input_ids", np.array([[5, 7, 97, 2]])), ("position_ids", np.array([[0, 1, 2, 40]]))):
        fake.log.clear()
        with pytest.raises(GuardError) as ours:
            runner.entry("prefill")(**{**good, name: bad})
        assert not [e for e in fake.log if e[0] == "launch"]
        with pytest.raises(GuardError) as theirs:
            cpu.entry("prefill")(**{k: torch.from_numpy(v) for k, v in {**good, name: bad}.items()})
        assert str(ours.value) == str(theirs.value)
        assert str(ours.value).startswith(f"input {name!r} holds")


def test_the_load_command_runs_zeros_made_on_the_device(pointwise, fake, monkeypatch, capsys):  # noqa: F811
    """``aotpack-rt load``: its inputs are zeros made in device memory (``Runner.zeros``: no host
    array, so numpy is not imported for them) and its first answer comes to the host as bytes."""
    import json

    from aot.runtime import cli

    monkeypatch.setattr(drv, "Device", lambda ordinal: fake)
    assert cli.main(["load", str(pointwise), "--sizes", "batch=3", "--iters", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sizes"] == {"batch": 3} and report["median_ms"] is not None
    zeros = [e for e in fake.log if e[0] == "alloc"][1]  # after the weights': the input's 3 x 16 floats
    assert zeros == ("alloc", 3 * 16 * 4)
    launches = [e for e in fake.log if e[0] == "launch"]
    assert launches and all(words[3] == 3 for _, _, _, words in launches)  # s_batch


def test_the_load_command_reads_inputs_and_saves_outputs_as_safetensors(
    pointwise,  # noqa: F811
    fake,
    monkeypatch,
    capsys,
    tmp_path,
):
    """``aotpack-rt load --inputs IN --save-outputs OUT``: the inputs are the file's tensors by
    input name, read without numpy; the outputs are written as safetensors (``output_0``) that
    equal the model's; a file without a tensor per input, or both --inputs and --sizes, is a
    one-line error."""
    import json

    from safetensors.numpy import load_file, save_file

    from aot.runtime import cli

    monkeypatch.setattr(drv, "Device", lambda ordinal: fake)
    x = np.arange(5 * 16, dtype=np.float32).reshape(5, 16) - 30
    save_file({"x": x}, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    argv = ["load", str(pointwise), "--inputs", str(tmp_path / "in.safetensors"), "--save-outputs", str(out)]
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["saved_outputs"] == {str(out): ["output_0"]}
    w = np.frombuffer(ctypes.string_at(fake_weights(fake), 64), np.float32)
    np.testing.assert_array_equal(load_file(str(out))["output_0"], np.maximum(0, x * 2 + w))
    save_file({"y": x}, str(tmp_path / "wrong.safetensors"))
    assert cli.main(["load", str(pointwise), "--inputs", str(tmp_path / "wrong.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --inputs ") and "missing ['x']; not inputs ['y']" in err
    assert cli.main([*argv[:4], "--sizes", "batch=2"]) == 1
    assert "both choose the inputs" in capsys.readouterr().err


def fake_weights(fake) -> int:
    """The address of the weights' allocation: the fake device's first."""
    return next(iter(fake.buffers))


def test_zeros_are_device_arrays_of_zeros(pointwise, fake):  # noqa: F811
    from aot.errors import GuardError
    from aot.runtime import check
    from aot.runtime.runner import Runner

    runner = Runner(check(pointwise), fake)
    ctypes.memset(fake.alloc(1 << 10), 0xFF, 1 << 10)  # memory is not zero to begin with
    z = runner.zeros("float16", (4, 3))
    assert (z.dtype, z.shape, z.device, z.nbytes) == ("float16", (4, 3), (CUDA, 0), 24)
    assert z.tobytes() == bytes(24)
    out = runner.run((), {"x": runner.zeros("float32", (2, 16))})
    w = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    np.testing.assert_array_equal(out.numpy(), np.maximum(0, np.zeros((2, 16), np.float32) + w))
    with pytest.raises(GuardError, match="dtype 'complex64' is not one of"):
        runner.zeros("complex64", (1,))


def test_inputs_at_a_pitch_or_in_a_buffer_come_in_packed(pointwise, fake):  # noqa: F811
    """A slice of wider rows (``x[:, :16]``) comes in through one 2-D copy, and a host buffer without
    numpy (``memoryview.cast``) as a NumPy array does: the outputs equal the dense input's. A layout
    no 2-D copy packs (transposed) is refused, naming the input and its strides."""
    import array

    from aot.errors import GuardError
    from aot.runtime import check
    from aot.runtime.runner import Runner

    runner = Runner(check(pointwise), fake)
    w = np.frombuffer(ctypes.string_at(runner.weights_base, 64), np.float32)
    wide = np.arange(4 * 24, dtype=np.float32).reshape(4, 24) - 40
    want = np.maximum(0, wide[:, :16] * 2 + w)
    fake.log.clear()
    np.testing.assert_array_equal(runner.run((), {"x": wide[:, :16]}).numpy(), want)
    assert ("copy_rows", True) in fake.log
    packed = array.array("f", wide[:, :16].ravel().tolist())
    got = runner.run((), {"x": memoryview(packed).cast("B").cast("f", [4, 16])})
    np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(GuardError, match=r"input 'x': expected a contiguous.*strides \[1, 4\]"):
        runner.run((), {"x": np.ascontiguousarray(wide[:, :16].T).T})
