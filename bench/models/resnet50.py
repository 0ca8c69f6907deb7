"""timm's resnet50 with random weights at 224 x 224: ``x [B, 3, 224, 224] -> logits [B, 1000]``.

Built as the real-model suite builds its timm models (``tests/realmodels/zoo.py``): unmodified,
with trained-looking BatchNorm statistics (``lively``), since at initialization the network
gives every image nearly the same logits and a comparison with eager would prove nothing. With
``AOTPACK_BENCH_SMOKE=1`` (``bench/run.py --smoke``) images are 64 x 64, for a run on a CPU.
"""

import os
import sys
from pathlib import Path

from aot import Dim, Input, ModelSpec

ROOT = Path(__file__).resolve().parents[2]
NAME = "resnet50"
IMAGE = 64 if os.environ.get("AOTPACK_BENCH_SMOKE") == "1" else 224


def make_model():
    sys.path.insert(0, str(ROOT))
    from tests.realmodels.zoo import timm_model

    return timm_model(NAME, IMAGE)


batch = Dim("batch", 1, 32, buckets=(1, 8, 32))
spec = ModelSpec(module=make_model, inputs=[Input("x", (batch, 3, IMAGE, IMAGE))], dtype="float16", name=NAME)
