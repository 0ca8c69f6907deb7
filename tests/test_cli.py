"""The command line, as a user runs it: one readable line and a non-zero exit on every error."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

from aot import schema
from tests.conftest import model_path


def aotpack(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aot.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def test_build_load_guards_inspect(tmp_path):
    out = tmp_path / "b.tpk"
    r = aotpack("build", str(model_path("branchy")), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "wrote" in r.stderr

    r = aotpack("load", str(out), "--runs", "3")
    assert r.returncode == 0, r.stderr
    assert "output 0: float32[4, 16, 16]  max abs error vs build reference 0" in r.stdout
    assert "latency: median" in r.stdout

    r = aotpack("guards", str(out))
    assert r.returncode == 0 and "symbol seq: 10 <= seq <= 256, seq % 2 == 0" in r.stdout

    r = aotpack("inspect", str(out), "--json")
    info = json.loads(r.stdout)
    assert info["name"] == "branchy" and info["schema_version"] == list(schema.SCHEMA_VERSION)
    assert "weights.safetensors" in info["members"]


def test_load_with_inputs_file(tmp_path, built):
    import torch
    from safetensors.torch import save_file

    inputs = tmp_path / "in.safetensors"
    save_file({"x": torch.ones(2, 12, 16)}, inputs)
    r = aotpack("load", str(built("branchy")), "--inputs", str(inputs), "--runs", "1")
    assert r.returncode == 0, r.stderr
    assert "output 0: float32[2, 12, 16]" in r.stdout


def _one_line_error(r: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    # progress lines may come first; the error itself is exactly one line, and the last one
    assert len(errors) == 1 and lines[-1] == errors[0] and fragment in errors[0], r.stderr


def test_errors_are_one_line(tmp_path, built):
    _one_line_error(aotpack("load", str(tmp_path / "missing.tpk")), 1, "does not exist")
    junk = tmp_path / "junk.tpk"
    junk.write_bytes(b"not a zip")
    _one_line_error(aotpack("load", str(junk)), 1, "not a bundle")
    _one_line_error(
        aotpack("build", str(model_path("untraceable")), "-o", str(tmp_path / "u.tpk")),
        1,
        "untraceable.py:10",
    )
    assert not (tmp_path / "u.tpk").exists()
    r = aotpack("build", str(model_path("untraceable")), "-o", str(tmp_path / "u.tpk"))
    # torch's partial graph dumps and log lines stay out of the log: progress, then the one error
    progress = [line for line in r.stderr.splitlines()[:-1] if "… still tracing" not in line]  # heartbeats
    assert progress == [f"tracing {model_path('untraceable')} …"], r.stderr
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"x": torch.ones(2, 7, 16)}, bad)
    _one_line_error(aotpack("load", str(built("branchy")), "--inputs", str(bad)), 1, "seq >= 9")
    _one_line_error(aotpack("build", str(model_path("branchy")), "--arch", "volta"), 1, "--arch")


def test_an_arch_triton_cannot_compile_is_refused_before_tracing(tmp_path):
    out = tmp_path / "b.tpk"
    r = aotpack("build", str(model_path("small_mlp")), "-o", str(out), "--arch", "sm_80,sm_999")
    assert r.returncode != 0 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no "tracing …" line: refused before the trace
    assert lines[0].startswith("error: --arch sm_999: triton ") and "cannot compile cubins for it" in lines[0]
    assert "sm_80" in lines[0] and "sm_90" in lines[0]  # says which archs it can compile


def test_an_unwritable_output_folder_and_an_unknown_device_are_one_line_errors(tmp_path, built):
    missing = tmp_path / "no" / "such" / "b.tpk"
    r = aotpack("build", str(model_path("small_mlp")), "-o", str(missing))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "tracing" not in r.stderr, r.stderr
    assert f"cannot write {missing}: {missing.parent} is not a folder this user can write to" in r.stderr
    for device in ("tpu", "cuda:x"):
        r = aotpack("load", str(built("small_mlp")), "--device", device)
        assert r.returncode == 1 and r.stderr == (
            f"error: device {device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'\n"
        ), r.stderr


def test_load_benchmarks_and_checks(tmp_path, built):
    """``load --sizes/--iters/--warmup/--json/--save-outputs/--atol``: generated inputs at any
    admitted size, latency percentiles, a PASS/FAIL verdict against the build reference."""
    import torch
    from safetensors.torch import load_file

    from aot.loader import load
    from aot.tracer import instantiate, load_model_file

    bundle, saved = str(built("small_mlp")), tmp_path / "out.safetensors"
    r = aotpack(
        "load",
        bundle,
        "--sizes",
        "batch=5",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        "--save-outputs",
        str(saved),
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["sizes"] == {"batch": 5} and report["iters"] == 3 and report["warmup"] == 1
    lat = report["latency_ms"]
    assert (
        set(lat) == {"min", "median", "p90", "p99", "max"} and 0 < lat["min"] <= lat["median"] <= lat["max"]
    )
    assert report["outputs"] == [{"name": "0", "dtype": "float16", "shape": [5, 32], "max_abs_err": None}]
    assert report["passed"] is None and report["reference"] is None  # CPU, generated inputs: no reference
    # the saved outputs are the model's on the generated inputs (fp16 tolerance 1e-2)
    x = load(bundle).inputs_at({"batch": 5})["x"]
    spec = load_model_file(model_path("small_mlp"))
    with torch.no_grad():
        want = instantiate(spec)(x).float()
    got = load_file(saved)["0"].float()
    assert got.shape == (5, 32) and (got - want).abs().max().item() <= 1e-2 * max(
        1.0, want.abs().max().item()
    )

    r = aotpack("load", bundle, "--iters", "2")
    assert r.returncode == 0 and "PASS: max abs error 0 <= atol" in r.stdout, r.stdout
    r = aotpack("load", bundle, "--iters", "2", "--atol", "-1")
    assert r.returncode == 2 and "FAIL: max abs error 0 > atol -1 vs the build reference" in r.stdout
    r = aotpack("load", bundle, "--sizes", "batch=999")
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == (
        "error: requested size (batch): expected 1 <= batch <= 64, got 999 (declared in the model file)"
    )
    r = aotpack("load", bundle, "--sizes", "seq=3")
    assert (
        r.returncode == 1 and "unknown size symbol(s) ['seq']; the bundle's symbols are ['batch']" in r.stderr
    )


def test_quiet_build_prints_only_its_result(tmp_path):
    out = tmp_path / "q.tpk"
    r = aotpack("-q", "build", str(model_path("small_mlp")), "-o", str(out))
    assert r.returncode == 0 and out.is_file(), r.stderr
    assert r.stderr.splitlines() == [r.stderr.splitlines()[0]] and r.stderr.startswith(f"wrote {out} ("), (
        r.stderr
    )
    r = aotpack("-q", "-v", "build", str(model_path("small_mlp")))
    assert r.returncode == 2 and "--quiet and --verbose contradict each other" in r.stderr


def test_heartbeat_speaks_during_a_silent_stage_only(capsys):
    import time

    from aot.cli.progress import Progress

    progress = Progress()
    with progress.heartbeat("tracing", every=0.2):
        time.sleep(0.5)  # silent: two beats
        progress.say("  stage done")
        time.sleep(0.1)  # progress was just said: no beat
    beats = [line for line in capsys.readouterr().err.splitlines() if "still tracing" in line]
    assert len(beats) == 2 and beats[0].startswith("  … still tracing ("), beats
    progress.quiet = True
    with progress.heartbeat("tracing", every=0.05):
        time.sleep(0.2)
    progress.result("wrote x")
    assert capsys.readouterr().err == "wrote x\n"


def test_build_refuses_to_overwrite_its_model_or_a_file_that_is_not_a_bundle(tmp_path):
    import shutil

    model = tmp_path / "model.py"
    shutil.copy(model_path("small_mlp"), model)
    source = model.read_bytes()
    r = aotpack("build", str(model), "-o", str(model), "--force")  # not even with --force
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "tracing" not in r.stderr, r.stderr
    assert f"-o {model} is {model}, an input of this build; give the bundle another path" in r.stderr
    r = aotpack("build", "model.py", "-o", "./model.py", cwd=tmp_path)  # the same file by another name
    assert r.returncode == 1 and "an input of this build" in r.stderr, r.stderr
    assert model.read_bytes() == source

    out = tmp_path / "notes.tpk"
    out.write_text("not a bundle")
    r = aotpack("build", str(model), "-o", str(out))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "tracing" not in r.stderr, r.stderr
    assert "exists and is not an aotpack bundle; give another path, or --force to overwrite it" in r.stderr
    assert out.read_text() == "not a bundle"
    r = aotpack("build", str(model), "-o", str(out), "--no-fuse", "--force")
    assert r.returncode == 0 and zipfile.is_zipfile(out), r.stderr
    first = out.read_bytes()
    out.write_bytes(first.replace(b"small_mlp", b"other_mlp"))  # a bundle, even a damaged one, is replaced
    r = aotpack("build", str(model), "-o", str(out), "--no-fuse")
    assert r.returncode == 0 and out.read_bytes() == first, r.stderr
