"""Check a call's inputs against the bundle's guards, in microseconds.

Everything is prepared once at load: per input its dtype, rank and each dim as a static size or a
symbol; per symbol its admissible set; relations compiled by ``aot.symexpr`` (never ``eval``). A
call that fails gets a ``GuardError`` naming the input, dim, admissible set, value, and the model
line that introduced the guard. Guards that could not have come from a build (sizes beyond
``MAX_SIZE``, empty admissible sets, unknown symbols) are refused at load with ``BundleError``.

What a call may pass, and what happens to it:

- Each input must be a dense (strided) ``torch.Tensor`` of the guarded dtype and rank, on the
  runner's device (a GPU runner's is the GPU named at load, else the one current then). Anything
  else (a list, a NumPy array, a sparse or nested tensor, a tensor on another device) is a
  ``GuardError`` that says what was expected; nothing is converted or moved across devices.
- Memory layout is not part of the contract. An input that is not contiguous (a transposed or
  sliced view, ``channels_last``) or whose elements overlap in memory (``expand()``, stride 0,
  ``as_strided``) is copied once into a contiguous tensor before the program sees it, so kernels
  and views in the program always get the row-major layout the build traced. The caller's tensor
  is never written. Contiguous inputs are used as they are, without a copy.
- Inputs are passed by position in the bundle's input order or by name, not both, and all of them.
- State inputs (``InputGuard.state``: a KV cache) are the runner's, never the caller's: they are not
  among ``names``, and a call that passes one by name is a ``GuardError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aot.errors import GuardError
from aot.guards import MAX_RELATION_NODES, MAX_RELATIONS, MAX_SIZE, GuardCore

__all__ = ["MAX_RELATIONS", "MAX_RELATION_NODES", "MAX_SIZE", "GuardChecker"]


class GuardChecker(GuardCore):
    """The guards' checks on torch tensors: kind, dtype, rank and device, then the shared dims."""

    def __init__(self, guards: Any, dtypes: dict[str, Any]):
        super().__init__(guards, dtypes)
        self._placements: dict[Any, Any] = {}  # device -> its test of a tensor (``_placement``)

    def check(self, values: Sequence[Any], device: Any = None) -> dict[str, int]:
        """Validate inputs; returns the symbol values. Raises ``GuardError``.

        When ``values`` is a list, inputs that are not contiguous are replaced in it by contiguous
        copies (see the module docstring); the caller's tensors are not touched.
        """
        sizes: dict[str, int] = {}
        where: dict[str, tuple[str, int]] = {}  # symbol -> the input and dim that bound it
        on_device = self._placement(device)
        for k, ((name, dtype, dtype_name, dims), value) in enumerate(zip(self.inputs, values)):
            # the common case in the tests torch answers fastest (no torch.device made per call);
            # the first that fails leads to the one that says what was expected
            if not (
                isinstance(value, torch.Tensor)
                and value.layout is torch.strided
                and not value.is_nested
                and value.dtype == dtype
                and value.ndim == len(dims)
                and on_device(value)
            ):
                self._refuse(name, dtype, dtype_name, dims, value, device)
            self.bind_dims(name, dims, value.shape, sizes, where)
            if not value.is_contiguous() and isinstance(values, list):
                values[k] = value.contiguous()
        if self._relations:
            self.check_relations(sizes)
        return sizes

    def _placement(self, device: Any) -> Any:
        """A test of a tensor's device against ``device`` (a CUDA one with its index, as the
        loader makes it), made once per device."""
        test = self._placements.get(device)
        if test is None:
            if device is None:
                test = _anywhere
            elif device.type == "cpu":
                test = _on_cpu
            elif device.type == "cuda" and device.index is not None:
                index = device.index
                test = lambda value: value.is_cuda and value.get_device() == index  # noqa: E731
            elif device.type == "cuda":  # the GPU current at the call
                test = _on_current_gpu
            else:
                test = lambda value: value.device.type == device.type  # noqa: E731
            self._placements[device] = test
        return test

    @staticmethod
    def _refuse(name: str, dtype: Any, dtype_name: str, dims: tuple, value: Any, device: Any) -> None:
        """The ``GuardError`` for an input that failed ``check``'s test: what was expected."""
        if not isinstance(value, torch.Tensor):
            raise GuardError(f"input {name!r}: expected a tensor, got {type(value).__name__}")
        if value.layout != torch.strided or value.is_nested:
            kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
            raise GuardError(f"input {name!r}: expected a dense (strided) tensor, got a {kind} one")
        if value.dtype != dtype:
            raise GuardError(
                f"input {name!r}: expected dtype {dtype_name}, got {str(value.dtype).removeprefix('torch.')}"
            )
        if value.dim() != len(dims):
            raise GuardError(
                f"input {name!r}: expected rank {len(dims)} [{', '.join(map(str, dims))}], "
                f"got rank {value.dim()} {list(value.shape)}"
            )
        index = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        want = device.type if index is None else f"{device.type}:{index}"
        raise GuardError(f"input {name!r}: expected a tensor on {want}, got one on {value.device}")


def _anywhere(value: torch.Tensor) -> bool:
    return True


def _on_cpu(value: torch.Tensor) -> bool:
    return value.is_cpu


def _on_current_gpu(value: torch.Tensor) -> bool:
    return value.is_cuda and value.get_device() == torch.cuda.current_device()
