"""DLPack in and out of the runtime, with NumPy on the host (``aot.runtime.arrays``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aot.errors import GuardError
from aot.runtime.arrays import CPU, DeviceArray, from_bytes, from_dlpack, rows_at_pitch


def test_a_numpy_array_comes_in_zero_copy_with_its_facts():
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    view = from_dlpack(a, "x")
    assert (view.ptr, view.dtype, view.shape, view.device_type) == (a.ctypes.data, "float16", (3, 4), CPU)
    assert view.contiguous and view.nbytes == 24
    t = from_dlpack(a.T, "x")
    assert t.shape == (4, 3) and t.strides == (1, 4) and not t.contiguous


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "int32", "uint8", "bool"])
def test_a_device_array_goes_out_through_dlpack_zero_copy(dtype):
    a = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    out = DeviceArray(a.ctypes.data, dtype, a.shape, (CPU, 0), owner=a)
    b = np.from_dlpack(out)
    assert b.ctypes.data == a.ctypes.data and b.dtype == a.dtype and b.shape == a.shape
    del out  # the consumer's array keeps the memory's owner alive
    np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(DeviceArray(a.ctypes.data, dtype, a.shape, (CPU, 0), owner=a).numpy(), a)
    assert DeviceArray(a.ctypes.data, dtype, a.shape, (CPU, 0), owner=a).tobytes() == a.tobytes()


def test_a_device_array_comes_to_the_host_as_bytes_without_numpy():
    """``tobytes``: a device array through its copy function (after its ready callback), any dtype."""
    a = np.arange(6, dtype=np.uint16)  # bfloat16's bytes: numpy has no such dtype
    calls = []

    def copy(dst, src, nbytes):
        calls.append("copy")
        ctypes.memmove(dst, src, nbytes)

    out = DeviceArray(a.ctypes.data, "bfloat16", (2, 3), (2, 0), a, copy, lambda stream: calls.append(stream))
    assert out.tobytes() == a.tobytes() and calls == [None, "copy"]


def test_what_is_not_an_array_is_a_guard_error():
    with pytest.raises(GuardError, match=r"input 'x': expected an array with __dlpack__.*got list"):
        from_dlpack([1, 2], "x")
    with pytest.raises(GuardError, match="numpy has no bfloat16"):
        DeviceArray(0, "bfloat16", (1,), (CPU, 0)).numpy()


class _Producer:
    """A CPU DLPack producer that is not NumPy (the capsule path, as for torch or CuPy arrays)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_producer_comes_in_through_its_capsule():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    view = from_dlpack(_Producer(a), "x")
    assert (view.ptr, view.dtype, view.shape, view.device_type) == (a.ctypes.data, "int64", (3, 4), CPU)
    t = from_dlpack(_Producer(a.T), "x")
    assert t.strides == (1, 4) and not t.contiguous
    out = DeviceArray(a.ctypes.data, "int64", a.shape, (CPU, 0), owner=a)
    mine = from_dlpack(out, "x")  # a runner's output fed back: no capsule
    assert (mine.ptr, mine.dtype, mine.shape, mine.contiguous) == (a.ctypes.data, "int64", (3, 4), True)


def test_a_slice_of_wider_rows_goes_out_with_its_strides():
    """An output that is a slice of a wider buffer (the logits cut from their padded GEMM, computed
    into the caller's memory): DLPack carries its strides, ``numpy()`` packs it, and fed back as
    an input it is not taken for a dense array."""
    padded = np.arange(2 * 3 * 8, dtype=np.float16).reshape(2, 3, 8)
    out = DeviceArray(padded.ctypes.data, "float16", (2, 3, 5), (CPU, 0), owner=padded, strides=(24, 8, 1))
    want = padded[:, :, :5]
    b = np.from_dlpack(out)
    assert b.ctypes.data == padded.ctypes.data and b.strides == want.strides
    np.testing.assert_array_equal(b, want)
    host = out.numpy()
    assert host.flags.c_contiguous
    np.testing.assert_array_equal(host, want)
    assert out.span == (24 + 2 * 8 + 5) * 2 and out.nbytes == 2 * 3 * 5 * 2
    view = from_dlpack(out, "x")
    assert view.strides == (24, 8, 1) and not view.contiguous
    dense = DeviceArray(padded.ctypes.data, "float16", (2, 3, 8), (CPU, 0), owner=padded, strides=(24, 8, 1))
    assert dense.strides is None  # row-major strides are the dense array's


def test_layouts_one_2d_copy_packs():
    """``rows_at_pitch``: (row bytes, pitch bytes, rows) of rows at one pitch; None for any other layout."""
    assert rows_at_pitch((2, 3, 5), (24, 8, 1), 2) == (10, 16, 6)  # x[:, :, :5] of [2, 3, 8]
    assert rows_at_pitch((4, 16), (24, 1), 4) == (64, 96, 4)
    assert rows_at_pitch((1, 7), (99, 1), 4) == (28, 28, 1)  # one row: dense
    assert rows_at_pitch((3, 4), (1, 3), 4) is None  # transposed
    assert rows_at_pitch((3, 4), (0, 1), 4) is None  # broadcast rows
    assert rows_at_pitch((2, 3, 5), (40, 8, 1), 2) is None  # gaps at two levels
    assert rows_at_pitch((6,), (2,), 4) is None  # every other element


def test_host_buffers_come_in_without_numpy():
    """Any object with the buffer protocol is a host array: its format names the dtype."""
    import array

    data = array.array("q", range(8))
    view = from_dlpack(memoryview(data).cast("B").cast("q", [2, 4]), "ids")
    assert (view.dtype, view.shape, view.device_type, view.contiguous) == ("int64", (2, 4), CPU, True)
    assert ctypes.string_at(view.ptr, view.nbytes) == data.tobytes()
    assert from_dlpack(b"\x01\x02", "b").dtype == "uint8"
    assert from_dlpack(array.array("f", [1.0]), "f").shape == (1,)
    with pytest.raises(GuardError, match=r"input 'x': buffer format 'c' is none"):
        from_dlpack(memoryview(b"ab").cast("c"), "x")


def test_a_strided_array_comes_to_the_host_as_its_elements():
    """``tobytes`` of a slice of wider rows packs its rows (it copied the first bytes of the span)."""
    padded = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    out = DeviceArray(padded.ctypes.data, "float32", (2, 5), (CPU, 0), owner=padded, strides=(8, 1))
    assert out.tobytes() == padded[:, :5].tobytes()
    odd = DeviceArray(padded.ctypes.data, "float32", (2, 3), (CPU, 0), owner=padded, strides=(8, 2))
    assert odd.tobytes() == padded[:, :6:2].tobytes()


def test_raw_bytes_come_in_as_the_named_array():
    """``from_bytes``: bytes off the wire as a row-major array of a named dtype (float16 and
    bfloat16 have no buffer format); a size that does not fit is a guard error."""
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    data = a.tobytes()
    view = from_bytes(data, "float16", (2, 3), "x")
    assert (view.dtype, view.shape, view.contiguous) == ("float16", (2, 3), True)
    assert ctypes.string_at(view.ptr, view.nbytes) == data
    assert from_bytes(bytearray(4), "bfloat16", [1, 2], "x").nbytes == 4
    with pytest.raises(
        GuardError, match=r"input 'x': expected 12 contiguous bytes for float16 \[2, 3\], got 10"
    ):
        from_bytes(data[:10], "float16", (2, 3), "x")
    with pytest.raises(GuardError, match="dtype 'half' is none of"):
        from_bytes(data, "half", (2, 3), "x")
