"""The command line, as a user runs it: one readable line and a non-zero exit on every error.

Commands run in this process (``run_aotpack``: ``aot.cli.main``, what the console script calls);
``aotpack_process`` starts ``python -m aot.cli`` where the test is about what the process writes."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

from aot import schema
from tests.conftest import HANG_GUARD_S, model_path, run_aotpack

aotpack = run_aotpack


def aotpack_process(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aot.cli", *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=cwd,
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
    r = aotpack_process("build", str(model_path("untraceable")), "-o", str(tmp_path / "u.tpk"))
    _one_line_error(r, 1, "untraceable.py:10")
    assert not (tmp_path / "u.tpk").exists()
    # torch's partial graph dumps and log lines (its C++ ones too) stay out of the process's
    # stderr: progress, then the one error
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
    assert (r.returncode, r.stderr) == (
        1,
        f"error: cannot write {missing}: the folder {missing.parent} does not exist; create it first\n",
    )
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
    """Beats come after ``every`` seconds of silence, not before (counted in beats and in a silence
    far shorter than ``every``, so a loaded machine cannot change the outcome)."""
    import time

    from aot.cli.progress import Progress

    progress = Progress()
    beats: list[str] = []
    with progress.heartbeat("tracing", every=0.2):
        for _ in range(int(HANG_GUARD_S / 0.05)):  # until two beats: a guard against a hang only
            beats += [ln for ln in capsys.readouterr().err.splitlines() if "still tracing" in ln]
            if len(beats) >= 2:
                break
            time.sleep(0.05)
    assert len(beats) >= 2 and all(b.startswith("  … still tracing (") for b in beats), beats
    with progress.heartbeat("tracing", every=600.0):
        progress.say("  stage done")
        time.sleep(0.3)  # far less silence than a beat needs
    assert capsys.readouterr().err == "  stage done\n"
    progress.quiet = True
    with progress.heartbeat("tracing", every=0.05):
        time.sleep(0.2)
    progress.result("wrote x")
    assert capsys.readouterr().err == "wrote x\n"


MHA_MODEL = """
from torch import nn
from aot import Dim, Input, ModelSpec

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.out(y)

spec = ModelSpec(module=Net, inputs=[Input("x", (Dim("batch", 1, 8), Dim("seq", 1, 64), 32))])
"""


def test_a_build_keeps_the_declared_range_or_says_why_not(tmp_path):
    """nn.MultiheadAttention at batch 1 / seq 1 once narrowed the contract with a bare note; now
    the build keeps every declared size (size 1 checked against eager), and a model that truly
    cannot cover its range fails with the guard and its line, or narrows only when allowed, loudly."""
    model = tmp_path / "mha.py"
    model.write_text(MHA_MODEL)
    r = aotpack("build", str(model), "-o", str(tmp_path / "mha.tpk"))
    assert r.returncode == 0, r.stderr
    assert "batch, seq = 1 runs the general trace: checked against eager" in r.stderr
    guards = aotpack("guards", str(tmp_path / "mha.tpk")).stdout
    assert "symbol batch: 1 <= batch <= 8  (declared 1..8)" in guards
    assert "symbol seq: 1 <= seq <= 64  (declared 1..64)" in guards

    reshape = model_path("guards/reshape")
    _one_line_error(aotpack("build", str(reshape), "-o", str(tmp_path / "r.tpk")), 1, "")
    r = aotpack("build", str(reshape), "-o", str(tmp_path / "r.tpk"))
    assert r.stderr.splitlines()[-1] == (
        "error: the build cannot cover every declared size: seq 1..64 admits only 2 <= seq <= 64, "
        "seq % 2 == 0 (seq % 2 == 0 at tests/data/guards/reshape.py:17: x = x.reshape(B, T // 2, 2 * C)"
        ".reshape(B, T, C)); the model needs seq to be a multiple of 2: declare Dim('seq', 2, 64, multiple_of=2) "
        "and pad or resize inputs to a multiple of 2 (the loader refuses other sizes with a GuardError that names "
        "it); change the model at those lines, declare narrower Dims, or accept the "
        "narrower contract with --allow-narrowing (ModelSpec(allow_narrowing=True))"
    )
    r = aotpack("build", str(reshape), "-o", str(tmp_path / "r.tpk"), "--allow-narrowing", "-q")
    assert r.returncode == 0
    warning = "warning: narrowed as allowed: seq declared 1..64 admits only 2 <= seq <= 64, seq % 2 == 0"
    assert r.stderr.splitlines()[0].strip().startswith(warning), r.stderr


TOKEN_MODEL = """
from torch import nn
from aot import Dim, Input, ModelSpec

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)

    def forward(self, ids):
        return self.emb(ids).sum(-1)

spec = ModelSpec(module=Net, inputs=[INPUTS])
"""


def test_spec_mistakes_are_named_as_spec_mistakes_before_or_instead_of_a_trace(tmp_path):
    cases = {
        # token ids without low/high: values in [-1, 1) index the embedding at -1
        'Input("ids", (1, Dim("seq", 1, 32)), dtype="int64")': (
            "error: model.py:11: the model fails in eager PyTorch on inputs built from the spec "
            "(ids int64[1, seq] in [-1, 1)): IndexError: index out of range in self; fix the Inputs' "
            "shape, dtype or low/high (token ids: dtype='int64', low=0, high=the vocabulary size)"
        ),
        # no int64 dtype: float ids
        'Input("ids", (1, Dim("seq", 1, 32)))': (
            "error: model.py:11: the model fails in eager PyTorch on inputs built from the spec "
            "(ids float32[1, seq] in [-1, 1)): RuntimeError: Expected tensor for argument #1 'indices'"
        ),
        'Input("ids", (1, Dim("seq", 1, 32)), dtype="int64", high=100), Input("mask", (1, 4))': (
            "error: the spec declares 2 inputs (ids, mask) but Net.forward(ids) takes 1 by position; "
            "remove the extra Inputs or name each after a parameter"
        ),
        'Input("id", (1, Dim("seq", 1, 32)), dtype="int64", high=100)': (
            "error: Input 'id' is not a parameter of Net.forward(ids); did you mean 'ids'?"
        ),
    }
    model = tmp_path / "model.py"
    for inputs, first_line in cases.items():
        model.write_text(TOKEN_MODEL.replace("INPUTS", inputs))
        r = aotpack("build", str(model), "-o", str(tmp_path / "m.tpk"), "-q")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.splitlines()[0].startswith(first_line), (inputs, r.stderr)
        assert not (tmp_path / "m.tpk").exists()
    # a name that is no parameter, bound by position: the build says how
    model.write_text(
        TOKEN_MODEL.replace("INPUTS", 'Input("tokens", (1, Dim("seq", 1, 32)), dtype="int64", high=100)')
    )
    r = aotpack("build", str(model), "-o", str(tmp_path / "m.tpk"))
    assert r.returncode == 0 and "  inputs passed to forward by position: tokens → ids" in r.stderr, r.stderr


def test_guard_sites_do_not_move_when_the_folder_becomes_a_repository(tmp_path):
    project = tmp_path / "proj"
    (project / "models").mkdir(parents=True)
    model = project / "models" / "net.py"
    model.write_text(model_path("guards/reshape").read_text())
    guards = project / "net.guards"
    r = aotpack("guards", str(model), "-o", str(guards))
    assert r.returncode == 0, r.stderr
    assert "at net.py:17  " in guards.read_text()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    r = aotpack("check", str(model), "--against", str(guards))
    assert r.returncode == 0, r.stdout + r.stderr


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


def test_running_out_of_gpu_memory_is_one_line_not_an_internal_error(monkeypatch, capsys):
    """torch's OutOfMemoryError from a call no command foresaw: one ``error:`` line saying what to
    do, the environment's exit code, no traceback (a CPU-only torch still has the class)."""
    import pytest
    import torch

    from aot.cli import cli, main
    from aot.errors import EnvError

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.28 GiB. GPU 0 has ...")

    monkeypatch.setattr(cli.commands["guards"], "callback", boom)
    with pytest.raises(SystemExit) as exit_:
        main(["guards", "x.tpk"])
    assert exit_.value.code == EnvError.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: out of GPU memory: CUDA out of memory. Tried to allocate 12.28 GiB; free the GPU of other processes or run smaller sizes"
    ]
