"""The CUDA driver through NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``): a context, one
stream, allocations, copies, cubin modules, launches and CUDA graphs. Nothing else of CUDA is
needed: no runtime library, no cuBLAS, no torch.

Every driver error becomes an ``EnvError`` naming the call and the driver's message. The kernels'
parameters are packed with ctypes into the ``void**`` array ``cuLaunchKernel`` takes (Triton's
ABI: the user arguments, then ``scratch`` trailing null pointers), once per size, so a launch is
one call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from aot.errors import EnvError
from aot.settings import setting

# ``cuda.bindings.driver``, imported by the first ``Device`` (``_bindings``): its import (~0.1 s,
# most of ``import aot.runtime`` before) then runs in the thread ``start`` makes the device in,
# beside the bundle's verification, and a ``check`` without a GPU never pays it.
cu: Any = None

DEFAULT_SHARED_LIMIT = 48 * 1024
# Programmatic dependent launch (a kernel built to wait inside for the one before it starts early):
# CUDA 12.3 on, as the torch loader (``aot.loader.cuda``); AOTPACK_DEPENDENT_LAUNCH=0 turns it off.
DEPENDENT_LAUNCH_DRIVER = 12030
DEPENDENT_LAUNCH_ENV = "AOTPACK_DEPENDENT_LAUNCH"
# Outputs' memory: ``cuMemAlloc`` blocks kept when their arrays go, for later outputs of the same
# size class (``Device.take``/``give``). The device's stream-ordered pool (``cuMemAllocAsync``) maps
# 32 MiB at its first allocation, however small (H200, driver 580: mlp's 2 KiB output cost 32
# MiB, a plain allocation 2 MiB); up to ``KEEP_BYTES`` of freed blocks wait for reuse, the rest go
# back to the driver.
KEEP_BYTES = 512 << 20


def block_size(nbytes: int) -> int:
    """The size class of ``nbytes``: a power of two from 512 bytes to 2 MiB, whole 2 MiB past it."""
    if nbytes > 2 << 20:
        return -(-nbytes // (2 << 20)) * (2 << 20)
    return max(512, 1 << (max(nbytes, 1) - 1).bit_length())


_starting: dict[int, tuple[threading.Thread, dict[str, Any]]] = {}
_starting_lock = threading.Lock()


def start(ordinal: int = 0) -> None:
    """Begin making GPU ``ordinal``'s ``Device`` on a thread of its own now: the bindings' import,
    ``cuInit`` and the context (0.1-0.2 s, the driver's calls outside the GIL) then run beside
    what the caller does next (importing the rest of the runtime, verifying the bundle), and
    ``started`` hands the ``Device`` over. ``aot.runtime.load`` calls it; a program that calls it
    first thing, before its imports, starts sooner (``aotpack-rt`` does)."""
    with _starting_lock:
        entry = _starting.get(ordinal)
        if entry is not None and (entry[0].is_alive() or "error" not in entry[1]):
            return  # under way, or made and not handed over yet; a failed one is tried again
        _starting[ordinal] = _begin(ordinal)


def started(ordinal: int = 0) -> Device:
    """The ``Device`` that ``start(ordinal)`` began (begun now if none was), once it is made; its
    error if it failed. Each start is handed over once: a later call makes another."""
    with _starting_lock:
        thread, out = _starting.pop(ordinal, None) or _begin(ordinal)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["device"]


def _begin(ordinal: int) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def make() -> None:
        try:
            out["device"] = Device(ordinal)
        except BaseException as e:  # noqa: BLE001 - raised again by ``started``
            out["error"] = e

    thread = threading.Thread(target=make, name=f"aotpack-rt-driver-{ordinal}", daemon=True)
    thread.start()
    return thread, out


def _bindings() -> Any:
    global cu
    if cu is None:
        try:
            from cuda.bindings import driver
        except ImportError:
            raise EnvError("aotpack-rt needs NVIDIA's cuda-bindings: pip install cuda-bindings") from None
        cu = driver
    return cu


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, text = cu.cuGetErrorString(err)
        raise EnvError(f"CUDA driver: {what} failed with {err.name} ({(text or b'').decode()})")
    return rest[0] if len(rest) == 1 else tuple(rest)


class Device:
    """The primary context of GPU ``ordinal``, current on this thread, with one stream of its own."""

    def __init__(self, ordinal: int = 0):
        _bindings()
        try:
            _check(cu.cuInit(0), "cuInit")
        except Exception as e:  # noqa: BLE001 - no libcuda at all raises the bindings' own error
            raise EnvError(
                f"no usable NVIDIA GPU or driver ({type(e).__name__}: {e}); aotpack-rt runs on a GPU"
            ) from None
        count = _check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise EnvError(f"GPU {ordinal} requested, this machine has {count}")
        self.ordinal = ordinal
        self.device = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = _check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._bound = threading.local()
        self.bind()
        attr = cu.CUdevice_attribute
        self.capability = (
            _check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "cap"
            ),
            _check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "cap"
            ),
        )
        self.driver_version = _check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        self.name = _check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        self.stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.stream_handle = int(self.stream)
        self._blocks: dict[int, list[int]] = {}  # size class -> freed blocks (``take``/``give``)
        self._kept = 0
        self._blocks_lock = threading.Lock()

    def bind(self) -> None:
        """Make the context current on this thread (once per thread: the driver keeps it)."""
        if getattr(self._bound, "done", False):
            return
        _check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._bound.done = True

    def alloc(self, nbytes: int) -> int:
        return int(_check(cu.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes} bytes)"))

    def take(self, nbytes: int) -> tuple[int, int]:
        """(address, size class) of a block for ``nbytes`` of a call's outputs: one an array gave
        back (``give``), else a new ``cuMemAlloc``. A block given back is free in the order of this
        device's stream, as ``cuMemFreeAsync`` on it would be: later work here writes it after the
        work before; a consumer on another stream has waited for the output (``DeviceArray``'s
        ``ready``) and keeps the array alive while it reads."""
        size = block_size(nbytes)
        with self._blocks_lock:
            free = self._blocks.get(size)
            if free:
                self._kept -= size
                return free.pop(), size
        return self.alloc(size), size

    def give(self, ptr: int, size: int) -> None:
        """A block ``take`` handed out, back for later outputs (past ``KEEP_BYTES``: freed)."""
        with self._blocks_lock:
            if self._kept + size <= KEEP_BYTES:
                self._blocks.setdefault(size, []).append(ptr)
                self._kept += size
                return
        self.free(ptr)

    def release_blocks(self) -> None:
        """Free every kept block (their arrays are gone)."""
        with self._blocks_lock:
            blocks, self._blocks, self._kept = self._blocks, {}, 0
        for free in blocks.values():
            for ptr in free:
                self.free(ptr)

    def free(self, ptr: int) -> None:
        if cu is not None and ptr:
            cu.cuMemFree(ptr)

    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory (``cuMemHostAlloc``): copies from it to the device run as DMA,
        without the driver's own staging of pageable memory."""
        return int(_check(cu.cuMemHostAlloc(max(nbytes, 1), 0), f"cuMemHostAlloc({nbytes} bytes)"))

    def free_host(self, ptr: int) -> None:
        if cu is not None and ptr:
            cu.cuMemFreeHost(ptr)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        return _check(cu.cuMemGetInfo(), "cuMemGetInfo")

    def to_device(self, dst: int, src: int, nbytes: int) -> None:
        _check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def to_host(self, dst: int, src: int, nbytes: int) -> None:
        self.to_host_async(dst, src, nbytes)
        self.synchronize()

    def to_host_async(self, dst: int, src: int, nbytes: int) -> None:
        """A copy to host memory in stream order, not waited for (``dst`` page-locked:
        ``host_alloc``; wait on an event recorded after it)."""
        _check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoHAsync")

    def zero(self, dst: int, nbytes: int) -> None:
        _check(cu.cuMemsetD8Async(dst, 0, nbytes, self.stream), "cuMemsetD8Async")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        _check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def copy_rows(
        self, dst: int, src: int, width: int, pitch: int, rows: int, from_host: bool = False
    ) -> None:
        """``rows`` rows of ``width`` bytes, ``pitch`` bytes apart at ``src`` (device memory, or
        host memory with ``from_host``), packed at ``dst`` in device memory."""
        p = cu.CUDA_MEMCPY2D()
        p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        if from_host:
            p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
            p.srcHost = src
        else:
            p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice = src
        p.srcPitch = pitch
        p.dstDevice, p.dstPitch = dst, width
        p.WidthInBytes, p.Height = width, rows
        _check(cu.cuMemcpy2DAsync(p, self.stream), "cuMemcpy2DAsync")

    def synchronize(self) -> None:
        _check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def event(self) -> Any:
        return _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def destroy_event(self, event: Any) -> None:
        if cu is not None:
            cu.cuEventDestroy(event)

    def record(self, event: Any) -> None:
        _check(cu.cuEventRecord(event, self.stream), "cuEventRecord")

    def wait(self, event: Any, stream: int | None) -> None:
        """Order ``stream`` (a consumer's raw handle; None: the host) after ``event``."""
        if stream is None or stream == -1:
            _check(cu.cuEventSynchronize(event), "cuEventSynchronize")
        else:
            _check(cu.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    @property
    def dependent_launch(self) -> bool:
        return (
            self.driver_version >= DEPENDENT_LAUNCH_DRIVER
            and setting(DEPENDENT_LAUNCH_ENV, "1", ("0", "1")) == "1"
        )

    def capture(self, launch) -> Any:
        """A CUDA graph of what ``launch()`` enqueues on the stream, instantiated."""
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            launch()
        finally:
            graph = _check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        instance = _check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        _check(cu.cuGraphUpload(instance, self.stream), "cuGraphUpload")
        return graph, instance

    def replay(self, instance: Any) -> None:
        _check(cu.cuGraphLaunch(instance, self.stream), "cuGraphLaunch")


class Kernel:
    """One kernel of one cubin (the bundle's sha256 was checked before the bytes came here);
    ``dependent``: launched with programmatic stream serialization (``cuLaunchKernelEx``), which
    stream capture records as a programmatic edge of the graph."""

    def __init__(self, cubin: bytes, name: str, shared: int, num_warps: int, dependent: bool = False):
        self._image = ctypes.create_string_buffer(cubin, len(cubin))
        self.module = _check(cu.cuModuleLoadData(ctypes.addressof(self._image)), f"cuModuleLoadData({name})")
        self.function = _check(
            cu.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})"
        )
        if shared > DEFAULT_SHARED_LIMIT:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(cu.cuFuncSetAttribute(self.function, attr, shared), f"cuFuncSetAttribute({name})")
        self.name, self.shared, self.block = name, shared, 32 * num_warps
        self.dependent = dependent
        if dependent:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._attrs = [attr]

    def launch(self, grid: tuple[int, int, int], stream: Any, params: ctypes.Array) -> None:
        if self.dependent:
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = self.block, 1, 1
            config.sharedMemBytes, config.hStream = self.shared, stream
            config.attrs, config.numAttrs = self._attrs, 1
            _check(
                cu.cuLaunchKernelEx(config, self.function, ctypes.addressof(params), 0),
                f"cuLaunchKernelEx({self.name})",
            )
            return
        _check(
            cu.cuLaunchKernel(
                self.function, *grid, self.block, 1, 1, self.shared, stream, ctypes.addressof(params), 0
            ),
            f"cuLaunchKernel({self.name})",
        )


_KINDS = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64}


def pack_params(values: list[tuple[str, int]]) -> tuple[ctypes.Array, list]:
    """[(kind, value)] → the ``void**`` array cuLaunchKernel takes, and the storage it points to
    (both must outlive every launch that uses them, a graph's capture included)."""
    storage = [_KINDS[kind](value) for kind, value in values]
    array = (ctypes.c_void_p * max(len(storage), 1))(*[ctypes.addressof(s) for s in storage])
    return array, storage


def destroy_graph(graph: Any, instance: Any) -> None:
    if cu is not None:
        cu.cuGraphExecDestroy(instance)
        cu.cuGraphDestroy(graph)
