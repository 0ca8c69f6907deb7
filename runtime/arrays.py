"""Arrays in and out of the runtime through DLPack, without torch.

In: any object with ``__dlpack__`` (a torch, CuPy or JAX array on the GPU, or a NumPy array on the
host) becomes an ``ArrayView`` — its data pointer, device, dtype name, shape and strides, read
from the producer's ``DLManagedTensor`` — and the capsule is kept alive as long as the view is.
Out: ``DeviceArray`` is a dense row-major array over a pointer the runtime owns (device memory
from the runner) or borrows (host memory, in tests), which any DLPack consumer takes without a
copy (``torch.from_dlpack``, ``cupy.from_dlpack``, ``numpy.from_dlpack`` for host arrays), and
which ``numpy()`` copies to the host.

The structs are DLPack's stable ABI (``dlpack.h`` v0.8, unversioned capsules named "dltensor").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from aot.dtypes import ITEMSIZE
from aot.errors import GuardError

# DLDeviceType
CPU = 1
CUDA = 2
CUDA_HOST = 3
DEVICE_NAMES = {CPU: "cpu", CUDA: "cuda", CUDA_HOST: "cuda_host"}

# (DLDataTypeCode, bits) <-> the bundle's dtype names
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6
_CODES: dict[str, tuple[int, int]] = {
    "float16": (_FLOAT, 16),
    "bfloat16": (_BFLOAT, 16),
    "float32": (_FLOAT, 32),
    "float64": (_FLOAT, 64),
    "int8": (_INT, 8),
    "int16": (_INT, 16),
    "int32": (_INT, 32),
    "int64": (_INT, 64),
    "uint8": (_UINT, 8),
    "bool": (_BOOL, 8),
}
_NAMES = {code: name for name, code in _CODES.items()}
DTYPES = tuple(_CODES)  # the dtypes a ``DeviceArray`` may hold


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]

_USED = b"used_dltensor"

# Exported tensors still held by a consumer: key (the struct's address) -> the struct, its shape
# array and the array that owns the memory. One deleter serves them all; it is never freed, since a
# consumer may free its tensor while the interpreter shuts down, after this module is torn down.
_LIVE: dict[int, tuple] = {}


@_DELETER
def _release(pointer) -> None:
    try:
        _LIVE.pop(ctypes.cast(pointer, ctypes.c_void_p).value, None)
    except Exception:  # noqa: BLE001 - at interpreter exit the module's globals may be gone
        pass


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CAPSULE_DESTRUCTOR
def _unconsumed(capsule: int) -> None:
    """A capsule dropped before any consumer took it ("dltensor" still its name): release it."""
    try:
        name = b"dltensor"
        if _api.PyCapsule_IsValid(ctypes.cast(capsule, ctypes.py_object), name):
            _LIVE.pop(_api.PyCapsule_GetPointer(ctypes.cast(capsule, ctypes.py_object), name), None)
    except Exception:  # noqa: BLE001 - at interpreter exit the module's globals may be gone
        pass


_api.Py_IncRef.argtypes = [ctypes.py_object]
_api.Py_IncRef(_release)
_api.Py_IncRef(_unconsumed)


def dtype_code(name: str) -> tuple[int, int]:
    return _CODES[name]


class ArrayView:
    """What a DLPack producer handed in: read-only facts plus the object that keeps it alive."""

    __slots__ = ("ptr", "device_type", "device_id", "dtype", "shape", "strides", "_keep")

    def __init__(self, ptr, device_type, device_id, dtype, shape, strides, keep):
        self.ptr, self.device_type, self.device_id = ptr, device_type, device_id
        self.dtype, self.shape, self.strides, self._keep = dtype, shape, strides, keep

    @property
    def contiguous(self) -> bool:
        return self.strides is None or self.strides == row_major(self.shape)

    @property
    def rows(self) -> tuple[int, int, int] | None:
        """``rows_at_pitch``'s (row bytes, pitch bytes, rows) of a strided view; None where dense."""
        if self.contiguous:
            return None
        return rows_at_pitch(self.shape, self.strides, ITEMSIZE[self.dtype])

    @property
    def nbytes(self) -> int:
        return array_bytes(self.dtype, self.shape)


def rows_at_pitch(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> tuple[int, int, int] | None:
    """Where an array of ``shape`` and element ``strides`` is rows of contiguous elements at one
    pitch (a slice of a wider row-major array, ``x[:, :n]``): (row bytes, pitch bytes, rows),
    what one 2-D copy packs. None for any other layout (broadcast, transposed, gaps in two dims)."""
    merged: list[list[int]] = []  # [size, stride], innermost first: dims that read as one merge
    for n, st in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if merged and st == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= n
        else:
            merged.append([n, st])
    if not merged:
        return (itemsize, itemsize, 1)
    if merged[0][1] != 1 or len(merged) > 2:
        return None
    width = merged[0][0]
    rows, pitch = merged[1] if len(merged) == 2 else (1, width)
    if pitch < width:
        return None
    return (width * itemsize, pitch * itemsize, rows)


def strides_at_pitch(shape: tuple[int, ...], pitch: int) -> tuple[int, ...]:
    """Element strides of ``shape`` whose rows (every index but the last) lie ``pitch`` apart:
    ``rows_at_pitch``'s layout, the other way round."""
    strides = [1] * len(shape)
    n = pitch
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = n
        n *= shape[i]
    return tuple(strides)


def array_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense array of ``dtype`` and ``shape``."""
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the buffer protocol's view of an object's memory)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_PYBUF_RECORDS_RO = 0x0010 | 0x0008 | 0x0004  # strides, nd, format; read-only is enough
# buffer formats (``struct``'s native codes) -> the bundle's dtype names (``l``: by its size)
_FORMATS = {"e": "float16", "f": "float32", "d": "float64", "b": "int8", "h": "int16", "i": "int32",
            "q": "int64", "B": "uint8", "?": "bool"}  # fmt: skip
_api.PyObject_GetBuffer.restype = ctypes.c_int
_api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_api.PyBuffer_Release.restype = None
_api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]


class _Held:
    """A buffer taken with ``PyObject_GetBuffer``: released once the view is dropped."""

    __slots__ = ("view",)

    def __init__(self, view: _PyBuffer):
        self.view = view

    def __del__(self):
        _api.PyBuffer_Release(ctypes.byref(self.view))


def _held(value: Any, name: str) -> _Held:
    """``value``'s buffer, taken (its address: ``.view.buf``) until the ``_Held`` goes."""
    view = _PyBuffer()
    if _api.PyObject_GetBuffer(value, ctypes.byref(view), _PYBUF_RECORDS_RO) != 0:
        raise GuardError(f"input {name!r}: its buffer could not be taken")
    return _Held(view)


def _from_buffer(value: Any, name: str) -> ArrayView | None:
    """A host array from any object with the buffer protocol (``memoryview(data).cast("q",
    [1, 8])``, ``array.array``, ``bytes``): inputs without numpy. None where it has none."""
    try:
        face = memoryview(value)
    except TypeError:
        return None
    fmt = face.format.lstrip("@=")
    dtype = {"l": f"int{8 * face.itemsize}", "L": None}.get(fmt, _FORMATS.get(fmt))
    if dtype not in _CODES or ITEMSIZE[dtype] != face.itemsize:
        raise GuardError(
            f"input {name!r}: buffer format {face.format!r} is none of the dtypes a bundle speaks "
            f"({', '.join(f'{k!r} {v}' for k, v in _FORMATS.items())})"
        )
    if face.strides and any(st % face.itemsize for st in face.strides):
        raise GuardError(f"input {name!r}: buffer strides {list(face.strides)} are not whole elements")
    strides = None
    if face.ndim and not face.c_contiguous:
        strides = tuple(st // face.itemsize for st in face.strides)
    held = _held(value, name)
    return ArrayView(held.view.buf or 0, CPU, 0, dtype, tuple(face.shape), strides, (held, value))


def from_bytes(data: Any, dtype: str, shape: tuple[int, ...], name: str) -> ArrayView:
    """A row-major host array of ``dtype`` and ``shape`` over the bytes of ``data`` (``bytes``,
    ``bytearray``, ``mmap``, any contiguous buffer): what a server reads off the wire, float16 and
    bfloat16 included, which have no buffer format."""
    if dtype not in _CODES:
        raise GuardError(f"input {name!r}: dtype {str(dtype)[:20]!r} is none of {sorted(_CODES)}")
    shape = tuple(int(d) for d in shape)
    nbytes = array_bytes(dtype, shape)
    face = memoryview(data)
    if not face.c_contiguous or face.nbytes != nbytes:
        raise GuardError(
            f"input {name!r}: expected {nbytes} contiguous bytes for {dtype} {list(shape)}, got "
            f"{face.nbytes}{'' if face.c_contiguous else ' not contiguous'}"
        )
    held = _held(data, name)
    return ArrayView(held.view.buf or 0, CPU, 0, dtype, shape, None, (held, data))


class _Consumed:
    """Owns a consumed capsule's ``DLManagedTensor``: calls its deleter once the view is dropped."""

    __slots__ = ("managed",)

    def __init__(self, managed):
        self.managed = managed

    def __del__(self):
        deleter = self.managed.contents.deleter
        if deleter:
            deleter(self.managed)


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of ``shape``."""
    strides, n = [], 1
    for s in reversed(shape):
        strides.append(n)
        n *= max(s, 1)
    return tuple(reversed(strides))


def from_dlpack(value: Any, name: str, stream: int | None = None) -> ArrayView:
    """``value``'s memory as an ``ArrayView``; ``stream``: the runner's CUDA stream, which the
    producer orders its pending work before (DLPack's ``stream`` argument). ``GuardError`` for
    anything that is not a DLPack array of a dtype a bundle speaks.

    Two producers skip the capsule (a call's host time: ~3x less on a busy box): this module's
    own ``DeviceArray`` (a runner's output fed to the next call) and a NumPy array, read through
    its ``__array_interface__``."""
    kind = type(value)
    if kind is DeviceArray:
        if value._ready is not None:
            value._ready(stream)
        return ArrayView(
            value.ptr, value.device[0], value.device[1], value.dtype, value.shape, value.strides, value
        )
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray" and value.dtype.name in _CODES:
        face = value.__array_interface__
        item = value.itemsize
        strides = None if face["strides"] is None else tuple(b // item for b in face["strides"])
        return ArrayView(face["data"][0], CPU, 0, value.dtype.name, value.shape, strides, value)
    if not hasattr(value, "__dlpack__") or not hasattr(value, "__dlpack_device__"):
        view = _from_buffer(value, name)
        if view is None:
            raise GuardError(
                f"input {name!r}: expected an array with __dlpack__ (torch, CuPy, JAX on the GPU, or "
                f"NumPy on the host) or a host buffer (memoryview, array.array), got {type(value).__name__}"
            )
        return view
    device_type, _ = value.__dlpack_device__()
    try:
        capsule = value.__dlpack__(stream=stream) if device_type == CUDA and stream else value.__dlpack__()
    except (TypeError, BufferError, RuntimeError) as e:
        raise GuardError(f"input {name!r}: its producer refused to export it through DLPack ({e})") from None
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise GuardError(f"input {name!r}: __dlpack__ returned no unconsumed 'dltensor' capsule")
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    managed = ctypes.cast(address, ctypes.POINTER(DLManagedTensor))
    _api.PyCapsule_SetName(capsule, _USED)  # ours now: the producer's capsule destructor leaves it
    keep = _Consumed(managed)
    t = managed.contents.dl_tensor
    code = (t.dtype.code, t.dtype.bits)
    if t.dtype.lanes != 1 or code not in _NAMES:
        raise GuardError(
            f"input {name!r}: DLPack dtype code {t.dtype.code} bits {t.dtype.bits} lanes {t.dtype.lanes} "
            f"is none of {sorted(_CODES)}"
        )
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    return ArrayView(
        (t.data or 0) + t.byte_offset,
        t.device.device_type,
        t.device.device_id,
        _NAMES[code],
        shape,
        strides,
        (keep, capsule, value),
    )


class DeviceArray:
    """An array over memory the runtime hands out, exported through DLPack: dense row-major, or
    with ``strides`` (elements, as DLPack's) where it is a slice of a larger buffer (gpt's logits
    cut from their padded GEMM, computed into the caller's memory: the torch loader hands the
    same slice out).

    ``owner``: what keeps the memory alive (the runner's allocation); ``copy_to_host(dst, src,
    nbytes)``: how ``numpy()`` reads device memory; ``ready``: called with the consumer's stream
    before it reads (orders it after the runner's work)."""

    def __init__(
        self,
        ptr: int,
        dtype: str,
        shape: tuple[int, ...],
        device: tuple[int, int],
        owner: Any = None,
        copy_to_host: Callable[[int, int, int], None] | None = None,
        ready: Callable[[int | None], None] | None = None,
        strides: tuple[int, ...] | None = None,
    ):
        if dtype not in _CODES:
            raise ValueError(f"dtype {dtype!r} has no DLPack code; expected one of {sorted(_CODES)}")
        self.ptr, self.dtype, self.shape, self.device = ptr, dtype, tuple(shape), device
        self._owner, self._copy_to_host, self._ready = owner, copy_to_host, ready
        dense = strides is None or tuple(strides) == row_major(self.shape)
        self.strides: tuple[int, ...] | None = None if dense else tuple(strides)

    @property
    def span(self) -> int:
        """Bytes from the first element to just past the last (``nbytes`` when dense)."""
        if self.strides is None or not all(self.shape):
            return self.nbytes
        return ITEMSIZE[self.dtype] * (1 + sum((n - 1) * st for n, st in zip(self.shape, self.strides)))

    @property
    def nbytes(self) -> int:
        return array_bytes(self.dtype, self.shape)

    def __repr__(self) -> str:
        kind = DEVICE_NAMES.get(self.device[0], str(self.device[0]))
        return f"DeviceArray({self.dtype}, {list(self.shape)}, {kind}:{self.device[1]})"

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream: int | None = None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("DeviceArray exports its own memory; copy=True is not supported")
        if self._ready is not None:
            self._ready(stream)
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        managed = DLManagedTensor()
        t = managed.dl_tensor
        t.data = self.ptr
        t.device = DLDevice(*self.device)
        t.ndim = ndim
        t.dtype = DLDataType(*_CODES[self.dtype], 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        strides = None
        if self.strides is None:
            t.strides = None  # row-major
        else:
            strides = (ctypes.c_int64 * ndim)(*self.strides)
            t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        managed.deleter = _release
        key = ctypes.addressof(managed)
        _LIVE[key] = (managed, shape, strides, self)  # until the consumer calls the deleter
        return _api.PyCapsule_New(key, b"dltensor", ctypes.cast(_unconsumed, ctypes.c_void_p))

    def tobytes(self) -> bytes:
        """A host copy of the array's elements in C order, without numpy (any dtype, bfloat16
        too); a strided array's rows are packed."""
        span = self.span
        out = ctypes.create_string_buffer(span)
        if self.device[0] == CPU:
            ctypes.memmove(out, self.ptr, span)
        else:
            if self._ready is not None:
                self._ready(None)
            self._copy_to_host(ctypes.addressof(out), self.ptr, span)
        if self.strides is None or not all(self.shape):
            return out.raw[: self.nbytes]
        item = ITEMSIZE[self.dtype]
        rows = rows_at_pitch(self.shape, self.strides, item)
        data = memoryview(out).cast("B")  # ``out.raw`` would copy the whole span at every use
        if rows is not None:
            width, pitch, count = rows
            return b"".join(data[r * pitch : r * pitch + width] for r in range(count))
        packed = bytearray()  # any other layout: element by element
        for index in _indices(self.shape):
            at = item * sum(i * st for i, st in zip(index, self.strides))
            packed += data[at : at + item]
        return bytes(packed)

    def numpy(self):
        """A host copy (``numpy.ndarray``); numpy is imported only here."""
        import numpy as np

        if self.dtype == "bfloat16":
            raise GuardError("numpy has no bfloat16; take the array through DLPack instead")
        dtype = np.dtype("bool" if self.dtype == "bool" else self.dtype)
        dense = self.strides is None or not all(self.shape)
        out = np.empty(self.shape if dense else self.span // dtype.itemsize, dtype=dtype)
        if self.device[0] == CPU:
            ctypes.memmove(out.ctypes.data, self.ptr, self.span)
        else:
            if self._ready is not None:
                self._ready(None)
            self._copy_to_host(out.ctypes.data, self.ptr, self.span)
        if dense:
            return out
        item = dtype.itemsize
        return np.lib.stride_tricks.as_strided(out, self.shape, [st * item for st in self.strides]).copy()


def _indices(shape: tuple[int, ...]):
    """Every index of ``shape`` in C order."""
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)
