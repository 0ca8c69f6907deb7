"""aotpack: ahead-of-time packaging of PyTorch models into verifiable bundles.

Model files import ``Dim``, ``Input``, ``EntryPoint`` and ``ModelSpec`` from here. This package imports only the
standard library, so the loader stays light; the model-file names come from ``aot.spec`` when first
used.
"""

from aot.errors import AotError, BundleError, CodegenError, EnvError, GuardError, SpecError, TraceError

_SPEC = ("Dim", "EntryPoint", "Input", "ModelSpec")

__version__ = "0.1.0"

__all__ = [
    "AotError",
    "BundleError",
    "CodegenError",
    "Dim",
    "EntryPoint",
    "EnvError",
    "GuardError",
    "Input",
    "ModelSpec",
    "SpecError",
    "TraceError",
    "__version__",
]


def __getattr__(name: str):
    """``Dim``, ``Input``, ``EntryPoint``, ``ModelSpec`` from ``aot.spec``, imported on first use:
    a loader that never reads a model file never pays for it (``aot.runtime``'s start)."""
    if name in _SPEC:
        from aot import spec

        return {
            "Dim": spec.Dim,
            "EntryPoint": spec.EntryPoint,
            "Input": spec.Input,
            "ModelSpec": spec.ModelSpec,
        }[name]
    raise AttributeError(f"module 'aot' has no attribute {name!r}")
