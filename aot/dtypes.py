"""The dtypes a bundle speaks, in one table: names, sizes, safetensors codes, torch dtypes, and the
tolerances every comparison against a reference uses.

A bundle names dtypes by torch's attribute name (``"float16"``). Everything else is looked up
here; ``torch_dtype`` imports torch only when called, so the schema and the review tools stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# name -> (itemsize in bytes, safetensors code)
_TABLE: dict[str, tuple[int, str]] = {
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float32": (4, "F32"),
    "float64": (8, "F64"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "int16": (2, "I16"),
    "int32": (4, "I32"),
    "int64": (8, "I64"),
    "bool": (1, "BOOL"),
    "complex64": (8, "C64"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
}

NAMES: tuple[str, ...] = tuple(_TABLE)
ITEMSIZE: dict[str, int] = {name: size for name, (size, _) in _TABLE.items()}
SAFETENSORS: dict[str, str] = {code: name for name, (_, code) in _TABLE.items()}  # code -> name
SAFETENSORS_CODE: dict[str, str] = {name: code for name, (_, code) in _TABLE.items()}  # name -> code

FLOATS: frozenset[str] = frozenset({"float16", "bfloat16", "float32", "float64"})
HALF: frozenset[str] = frozenset({"float16", "bfloat16"})
INTEGERS: frozenset[str] = frozenset({"int8", "uint8", "int16", "int32", "int64", "bool"})
# What a model's parameters and a user's inputs may be (a model file's ``ModelSpec``/``Input``).
MODEL_FLOATS: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
INPUT_DTYPES: tuple[str, ...] = MODEL_FLOATS + ("int8", "uint8", "int16", "int32", "int64", "bool")


@dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|got - want| <= atol + rtol * |want|``; a whole output when its
    worst error is at most ``rtol`` times its scale (the largest ``|want|``, at least 1)."""

    atol: float
    rtol: float


# Kernels compute half-precision chains in fp32 and round once where the reference rounds after
# every op; a different size can change a library's blocking: a few ulps of the output's scale.
TOLERANCE: dict[str, Tolerance] = {
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 2e-2),
    "float32": Tolerance(1e-4, 1e-4),
    "float64": Tolerance(1e-8, 1e-8),
}
# Integer and boolean outputs must match exactly.
EXACT = Tolerance(0.0, 0.0)


def tolerance(dtype: str) -> Tolerance:
    return TOLERANCE.get(dtype, EXACT)


def torch_dtype(name: str) -> Any:
    """``"float16"`` → ``torch.float16``; ``KeyError`` for a name outside ``NAMES`` or missing
    from this torch."""
    return torch_dtypes()[name]


def torch_dtypes() -> dict[str, Any]:
    """Every name of ``NAMES`` this torch has → its dtype (read from torch's own dtype objects, so
    no attribute is looked up by a name that came from a bundle)."""
    import torch

    present = {name_of(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return {name: present[name] for name in NAMES if name in present}


def name_of(dtype: Any) -> str:
    """``torch.float16`` → ``"float16"``."""
    return str(dtype).removeprefix("torch.")
