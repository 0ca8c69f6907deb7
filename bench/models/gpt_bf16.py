"""The example GPT (``models/gpt.py``) in bfloat16: the same module, inputs and buckets.

For timing the default build's bfloat16 forms against the library (``bench/device_session.sh``'s
``ab-gpt_bf16``), where the example models are all float16.
"""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))

import gpt  # noqa: E402

spec = replace(gpt.spec, dtype="bfloat16", name="gpt_bf16")
