"""Where a guard comes from: the user's (or the model library's) source line, shown the same way
on every machine.

Export runs the model's Python live, so when the shape environment records a guard, the line that
caused it is on the stack: the innermost frame inside aotpack's call into the model that is not
torch, the standard library or aotpack. A library file is shown relative to the folder it is
installed in (``transformers/masking_utils.py``), the user's relative to their project's root.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from aot.errors import TraceError

_PACKAGE_DIRS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {
        Path(__file__).parent,
        Path(__file__).parent.parent / "aot",
        Path(__file__).parent.parent / "codegen",
        Path(__file__).parent.parent / "packager",
        Path(__file__).parent.parent / "loader",
    }
)

# A folder holding one of these is the root of the model's project; guard sites are shown
# relative to it (else to the model file's folder), so a manifest reads the same on every checkout.
# Version-control folders are not markers: `git init` must not change a manifest.
_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg")


# What a bundle's shapes may depend on, said where a model makes one depend on tensor values.
VALUE_SHAPES = (
    "a bundle's shapes follow its inputs' shapes alone: keep the size fixed (a mask or torch.where "
    "instead of indices, a padded result), or move this line and what follows it out of the bundle: "
    "build the model up to the dense tensors it selects from (a detector's boxes and scores before "
    "NMS) and run the selection in Python on the runner's outputs"
)


def value_dependent_size(symbol: str, where: str = "", code: str = "") -> TraceError:
    """A size symbol that no input dim gives (``u0``: torch.nonzero's result, masked_select's, a
    size read with ``.item()``)."""
    code = f" ({code})" if code else ""
    return TraceError(
        f"{where}a size depends on tensor values, not on input shapes{code}: {symbol} is the size of a "
        f"result such as torch.nonzero's, masked_select's, unique's or a number read with .item() or .tolist() "
        "(a mixture of experts' slices sized by its routing); " + VALUE_SHAPES
    )


def float_from_sizes(where: str, what: str, value: str, code: str = "", why: str = "") -> str:
    """A float computed from sizes that a bundle cannot hold: a guard on one (``h0 / 4 == 1.0``: a
    bundle's guards are integer arithmetic), or a float function beyond true division and ``+ - *``
    (``why`` says which). A plain scale (``4 / (h // 7)``) is stored as ``aot.schema.SymFloat``."""
    code = f" ({code})" if code else ""
    why = f" ({why})" if why else ""
    return (
        f"{where}a float is computed from input sizes{code}: {what} is {value}{why}; a bundle stores floats of "
        f"sizes only as arguments made of true division, + - * and constants, and its guards as integer size "
        f"arithmetic (+ - * // %, comparisons, min/max); compute what the float is for as an integer size on "
        f"that line instead (F.interpolate(x, size=(h // p, w // p)) rather than scale_factor=(h / p / n, "
        f"w / p / n); a * h // b rather than int(h * (a / b))), or make the dims it reads static in the model file"
    )


def import_hint(e: BaseException) -> str:
    """What to do about a known environment problem somewhere in ``e``'s chain."""
    seen = 0
    while e is not None and seen < 16:
        if "torchvision::" in str(e):
            return (
                "; torchvision was built for another torch (the package index's wheels are CUDA builds, and "
                "transformers imports torchvision when Pillow is installed): install the torchvision that "
                "matches this torch, e.g. `pip install torchvision --index-url https://download.pytorch.org/whl/cpu`"
            )
        e, seen = e.__cause__ or e.__context__, seen + 1
    return ""


def _is_user_file(filename: str) -> bool:
    """A frame of the user's code or a library the model uses (transformers, timm): not torch,
    the standard library or aotpack itself."""
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    import torch

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    stdlib = os.path.dirname(os.path.realpath(os.__file__)) + os.sep
    return not (real.startswith(torch_dir) or real.startswith(stdlib) or real.startswith(_PACKAGE_DIRS))


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost user or library frame; only frames inside aotpack's own call into the model
    count (``frames`` is outermost first), so a launcher or test runner is never blamed."""
    ours = [os.path.realpath(f.filename).startswith(_PACKAGE_DIRS) for f in frames]
    end = len(frames)
    while end and ours[end - 1]:  # aotpack's own hook that asked (the guard-site recorder)
        end -= 1
    start = next((i + 1 for i in range(end - 1, -1, -1) if ours[i]), 0)
    inner = frames[start:end]
    for fr in reversed(inner):
        if _is_user_file(fr.filename):
            return fr
    return None


def _project_root(model_path: Path) -> Path:
    start = model_path.resolve().parent
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in _ROOT_MARKERS):
            return folder
    return start


def _library_roots() -> list[str]:
    """Folders packages are installed in (site-packages and the like), longest first."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return sorted({os.path.realpath(r) + os.sep for r in roots if r}, key=len, reverse=True)


def first_line(e: BaseException) -> str:
    """The first non-blank line of an exception's message (torch's run to many), else its type."""
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def error_site(e: BaseException, model_path: Path) -> tuple[str, traceback.FrameSummary | None]:
    """``"model.py:12: "`` for the user (or model library) frame that raised ``e``, and that frame;
    ``""`` and None when no such frame is on its traceback."""
    frame = user_frame(traceback.extract_tb(e.__traceback__))
    return (f"{display_path(frame.filename, model_path)}:{frame.lineno}: ", frame) if frame else ("", None)


def library_relative(filename: str) -> str:
    """A library file relative to the folder it is installed in (``timm/layers/helpers.py``),
    any other file as given: an error reads the same on every machine, as guard lines do."""
    real = os.path.realpath(filename)
    for root in _library_roots():
        if real.startswith(root):
            return os.path.relpath(real, root)
    return filename


def display_path(filename: str, model_path: Path) -> str:
    """A guard site as it reads on every machine: a library file relative to the folder it is
    installed in (``transformers/masking_utils.py``), the user's relative to their project."""
    real = os.path.realpath(filename)
    for root in _library_roots():
        if real.startswith(root):
            return os.path.relpath(real, root)
    rel = os.path.relpath(real, _project_root(model_path))
    return rel if not rel.startswith("..") else real


@contextlib.contextmanager
def record_guard_sites(sites: dict[int, traceback.FrameSummary | None]) -> Iterator[None]:
    """Remember the user's (or the model library's) frame for every guard the shape environment
    records.

    Export runs the model's Python live (non-strict), so that frame is on the stack when a guard
    is added; torch's own location often points inside torch (e.g. a reshape's meta).
    """
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    original = ShapeEnv._get_sloc

    def get_sloc(self, framework_loc=None):
        sloc = original(self, framework_loc)
        sites[id(sloc)] = user_frame(traceback.extract_stack())
        return sloc

    ShapeEnv._get_sloc = get_sloc
    try:
        yield
    finally:
        ShapeEnv._get_sloc = original
