"""Model file → ``ModelSpec``: import the user's file and read its module-level ``spec``."""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path

from aot.errors import SpecError
from aot.spec import ModelSpec
from aot.tracer.sites import import_hint, library_relative, user_frame


def load_model_file(path: str | os.PathLike) -> ModelSpec:
    """Import a model file and return its module-level ``spec``."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"model file {path} does not exist")
    mod_name = f"aot_model_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise SpecError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    # as `python model.py` would: modules beside the model file import (for the whole build, as
    # a model may import them when it is made, not only when the file is read)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        loader_spec.loader.exec_module(module)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
    except Exception as e:
        frame = user_frame(traceback.extract_tb(e.__traceback__))
        where = f"{library_relative(frame.filename)}:{frame.lineno}" if frame else str(path)
        raise SpecError(
            f"{where}: importing the model file failed: {type(e).__name__}: {e}{import_hint(e)}"
        ) from None
    spec = getattr(module, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise SpecError(
            f"{path} defines no `spec = aot.ModelSpec(...)` at module level "
            f"(found {type(spec).__name__}); see the README's model file section"
        )
    if spec.name is None:
        object.__setattr__(spec, "name", path.stem)
    object.__setattr__(spec, "extra", {**spec.extra, "path": str(path.resolve())})
    return spec
