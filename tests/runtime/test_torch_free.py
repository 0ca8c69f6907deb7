"""The runtime without torch (``aot.runtime``), on the CPU: a fresh interpreter where importing
torch fails opens, verifies and checks bundles through the runtime's API — archive verification,
signatures, guards on NumPy arrays with the torch loader's texts, memory bounds, and the refusal
of a bundle that is not library-free, naming the step. Bundles are built here, with torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S, ROOT

HERE = Path(__file__).resolve().parent

# Installed first in the child: any import of torch (or triton, or the torch loader) fails.
BLOCKER = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "safetensors") or name.startswith("aot.loader"):
            raise ImportError(f"{name} is blocked: the runtime must not import it")
sys.meta_path.insert(0, _Blocker())
"""


def run_torch_free(code: str) -> dict:
    """Run ``code`` in a fresh interpreter with torch blocked; it prints one JSON object."""
    script = BLOCKER + textwrap.dedent(code) + "\nassert 'torch' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pointwise(tmp_path_factory) -> Path:
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    out = tmp_path_factory.mktemp("rt") / "pointwise.tpk"
    pack(generate(trace(load_model_file(HERE / "pointwise.py")), ("sm_90",)), out)
    return out


@pytest.mark.slow  # builds a bundle (trace and compile: ~10 s)
def test_the_runtime_checks_a_bundle_without_torch(pointwise):
    got = run_torch_free(f"""
        import json
        import numpy as np
        import aot.runtime
        from aot.errors import GuardError

        checked = aot.runtime.check({str(pointwise)!r})
        entry = checked.entries[0]
        out = {{"inputs": list(checked.input_names), "steps": [s.kind.value for s in entry.steps]}}
        views = checked.arrays((), {{"x": np.zeros((8, 16), np.float32)}})
        out["sizes"] = checked.bind(views)[1]
        errors = []
        for bad in (np.zeros((8, 17), np.float32), np.zeros((17, 16), np.float32),
                    np.zeros((8, 16), np.float16), np.zeros((16, 8), np.float32).T, [1.0]):
            try:
                checked.bind(checked.arrays((), {{"x": bad}}))
            except GuardError as e:
                errors.append(str(e))
        out["errors"] = errors
        try:
            checked.arrays((), {{"y": np.zeros((8, 16), np.float32)}})
        except GuardError as e:
            out["unexpected"] = str(e)
        try:
            aot.runtime.check({str(pointwise)!r}, max_memory=64)
        except Exception as e:
            out["memory"] = type(e).__name__
        print(json.dumps(out))
    """)
    assert got["inputs"] == ["x"] and got["steps"] == ["kernel"]
    assert got["sizes"] == {"batch": 8}
    assert got["errors"] == [
        "input 'x' dim 1: expected static size 16, got 17",
        "input 'x' dim 0 (batch): expected 1 <= batch <= 16, got 17 (declared in the model file)",
        "input 'x': expected dtype float32, got float16",
        "input 'x': expected a contiguous (row-major) array or rows of one at a constant pitch (x[:, :n]), "
        "got shape [8, 16] strides [1, 8]; pass a contiguous copy",
        "input 'x': expected an array with __dlpack__ (torch, CuPy, JAX on the GPU, or NumPy on the host) "
        "or a host buffer (memoryview, array.array), got list",
    ]
    assert got["unexpected"] == "missing input 'x'; expected inputs ['x']"
    assert got["memory"] == "EnvError"


@pytest.mark.slow  # builds a bundle (trace and compile: ~10 s)
def test_the_guard_texts_are_the_torch_loaders(pointwise):
    """The same bad input gets the same ``GuardError`` text from both executors."""
    import torch

    from aot.errors import GuardError
    from aot.loader import load

    runner = load(pointwise)
    with pytest.raises(GuardError) as e:
        runner(x=torch.zeros(17, 16))
    assert (
        str(e.value)
        == "input 'x' dim 0 (batch): expected 1 <= batch <= 16, got 17 (declared in the model file)"
    )


def test_a_bundle_with_a_library_call_is_refused_naming_the_step(built):
    path = built("branchy")
    got = run_torch_free(f"""
        import json
        import aot.runtime
        from aot.errors import EnvError
        try:
            aot.runtime.check({str(path)!r})
        except EnvError as e:
            print(json.dumps({{"error": str(e)}}))
    """)
    assert "is a library call; aotpack-rt runs library-free bundles only" in got["error"]
    assert "step " in got["error"] and "aten." in got["error"] and "--library-free" in got["error"]


@pytest.mark.slow  # builds a bundle (trace and compile: ~10 s)
def test_a_corrupt_bundle_is_a_bundle_error_without_torch(pointwise, tmp_path):
    bad = tmp_path / "bad.tpk"
    data = bytearray(pointwise.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    got = run_torch_free(f"""
        import json
        import aot.runtime
        from aot.errors import BundleError
        try:
            aot.runtime.check({str(bad)!r})
            print(json.dumps({{"error": None}}))
        except BundleError as e:
            print(json.dumps({{"error": type(e).__name__}}))
    """)
    assert got["error"] in ("BundleError", "SignatureError")


def test_importing_the_runtime_imports_no_torch():
    got = run_torch_free("""
        import json
        import aot.runtime, aot.runtime.cli, aot.runtime.driver, aot.runtime.plan, aot.runtime.runner
        import aot.runtime.calls, aot.runtime.generate, aot.runtime.weights
        assert aot.runtime.load and aot.runtime.check and aot.runtime.DeviceArray and aot.runtime.Checked
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "numpy", "sympy"))
        print(json.dumps({"heavy": heavy, "driver": "cuda.bindings.driver" in sys.modules}))
    """)
    # numpy too: imported only for NumPy outputs; the driver bindings by the first Device
    assert got == {"heavy": [], "driver": False}


def test_the_console_entry_prints_one_error_line_without_torch(tmp_path):
    missing = tmp_path / "none.tpk"
    script = BLOCKER + f"from aot.runtime.cli import main\nsys.exit(main(['check', {str(missing)!r}]))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S
    )
    assert done.returncode == 1 and done.stderr.startswith("error:") and len(done.stderr.splitlines()) == 1


@pytest.mark.slow  # builds a bundle (trace and compile: ~10 s)
def test_the_console_entry_checks_and_refuses_to_load_without_a_gpu(pointwise):
    script = (
        BLOCKER
        + f"from aot.runtime.cli import main\nsys.exit(main(['check', {str(pointwise)!r}, '--json']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["library_free"] is True
    # no GPU to load it on (none visible, or no driver at all): one line, exit 1, no traceback
    script = BLOCKER + f"from aot.runtime.cli import main\nsys.exit(main(['load', {str(pointwise)!r}]))\n"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=HANG_GUARD_S,
        env=env,
    )
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: no usable NVIDIA GPU or driver")


@pytest.mark.slow  # builds a bundle (trace and compile: ~10 s)
def test_a_trust_list_is_kept_without_torch(pointwise, tmp_path):
    """Signed by a trusted key: accepted; unsigned or signed by another key: ``SignatureError``."""
    import shutil

    from aot.packager.sign import sign_bundle
    from aot.signing import write_key_pair

    write_key_pair(tmp_path / "ours")
    write_key_pair(tmp_path / "theirs")
    signed, foreign = tmp_path / "signed.tpk", tmp_path / "foreign.tpk"
    shutil.copy(pointwise, signed)
    shutil.copy(pointwise, foreign)
    sign_bundle(signed, tmp_path / "ours")
    sign_bundle(foreign, tmp_path / "theirs")
    trust = [str(tmp_path / "ours.pub")]
    got = run_torch_free(f"""
        import json
        import aot.runtime
        from aot.errors import SignatureError
        out = {{}}
        for name, path in (("signed", {str(signed)!r}), ("foreign", {str(foreign)!r}), ("unsigned", {str(pointwise)!r})):
            try:
                aot.runtime.check(path, trust={trust!r})
                out[name] = "accepted"
            except SignatureError as e:
                out[name] = str(e)
        print(json.dumps(out))
    """)
    assert got["signed"] == "accepted"
    assert got["unsigned"].startswith(f"{pointwise}: the bundle is not signed, and this loader trusts only")
    assert "signed by" in got["foreign"] and got["foreign"] != "accepted"
