"""transformers on this torch for the ``aot.hf`` tests: imported the way the real-model suite
does (``import_torchvision`` on a CPU torch), or every test here is skipped with the reason."""

from __future__ import annotations

import pytest

from tests.realmodels.conftest import require


@pytest.fixture(autouse=True)
def _transformers():
    require("transformers")
