"""aotpack-rt: run library-free bundles on the CUDA driver alone, without torch.

``load(path) -> Runner`` verifies the bundle (the same archive, signature, guard and memory checks
as the torch loader: ``aot.bundle``, ``aot.signature``, ``aot.guards``, ``aot.memory``) and loads
it on a GPU through NVIDIA's ``cuda-bindings``; ``runner(**inputs)`` takes DLPack arrays (torch,
CuPy, JAX on the GPU, NumPy on the host) and returns ``DeviceArray``s. ``check(path)`` does every
check that needs no GPU. Importing this package never imports torch (a test proves it); its
modules are imported when first used, so that ``start_driver()`` can begin the driver's start
before them.
"""

from __future__ import annotations

__all__ = ["Checked", "DeviceArray", "Runner", "check", "load", "start_driver"]


def start_driver(device: int = 0) -> None:
    """Begin the driver's start for GPU ``device`` on a thread now (``aot.runtime.driver.start``),
    before the rest of the runtime is imported: ``load`` then takes the device it made."""
    from aot.runtime import driver

    driver.start(device)


def __getattr__(name: str):
    """The API's names, their modules imported on first use, so that ``start_driver`` can run
    before them."""
    if name == "DeviceArray":
        from aot.runtime.arrays import DeviceArray

        return DeviceArray
    if name in ("Checked", "check"):
        from aot.runtime import plan

        return plan.Checked if name == "Checked" else plan.check_bundle
    if name in ("Runner", "load"):
        from aot.runtime import runner

        return runner.Runner if name == "Runner" else runner.load
    raise AttributeError(f"module 'aot.runtime' has no attribute {name!r}")
