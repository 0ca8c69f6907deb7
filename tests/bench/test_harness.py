"""The benchmark harness (``bench/run.py``, ``bench/worker.py``, ``bench/report.py``) without a GPU.

``test_smoke_run`` runs ``bench/run.py --device cpu --smoke`` for an example model (mlp) and a real
one (the Llama-style model from transformers, at decode.py's tiny config): the harness builds
the state dict and the bundles itself, as it does on the GPU machine, then runs eager,
torch.compile (cold and warm) and aotpack, each in its own process, through the worker's code.

Tolerance: aotpack's and torch.compile's outputs match eager's within float16's relative
tolerance of the outputs' scale (``aot.dtypes.tolerance``: max |x - eager| <= 1e-2 * max |eager|)
at every shape; the scale itself, not at least 1, since the tiny Llama's logits stay below 1.
Seen on a 2-core CPU (torch 2.13): aotpack 0 (its CPU path runs eager's ATen ops),
torch.compile 1.2e-3 of the scale (mlp) and 9e-4 (llama). An eager module whose rotary
``inv_freq`` was left uninitialized differed from the bundle by 2.5e-2 of the scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aot.dtypes import tolerance
from tests.conftest import HANG_GUARD_S, ROOT

SYSTEMS = ("eager", "compile", "aotpack")
# smoke shapes (bench/common.py SMOKE_SHAPES) -> (input bytes, output bytes), at float16 and int64
MLP_IO = {"B=1": (1 * 1024 * 2, 1 * 1024 * 2), "B=2": (2 * 1024 * 2, 2 * 1024 * 2)}
LLAMA_VOCAB = 128
LLAMA_IO = {f"B={b} S={s}": (b * s * 8, b * s * LLAMA_VOCAB * 2) for b, s in ((1, 8), (2, 8), (1, 1))}
# the mlp's four blocks (their LayerNorms' scale and shift folded into up's W and bias by the build,
# ``tracer.norm_scales``: up, down, their biases) and the final LayerNorm's two vectors
MLP_WEIGHT_BYTES = 2 * (4 * (1024 * 4096 + 4096 + 4096 * 1024 + 1024) + 2 * 1024)


def report(results: dict, tmp_path) -> str:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "report.py"), str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def row(text: str, model: str, shape: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {model} | {shape} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_smoke_run(tmp_path):
    from tests.realmodels.conftest import require

    require("transformers")
    out, bundles = tmp_path / "out", tmp_path / "bundles"
    cmd = [sys.executable, "bench/run.py", "--device", "cpu", "--smoke", "--models", "mlp,llama"]
    done = subprocess.run(
        [*cmd, "--bundles", str(bundles), "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # run.py's scratch folder (outputs, caches)
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "results-mlp-llama.json").read_text())
    assert results["smoke"] and results["device"]["gpu"] == "cpu"

    # the harness built what the run needed: the state dict every other system loads, the bundle
    for model in ("mlp", "llama"):
        assert (bundles / f"{model}.state.safetensors").is_file()
        assert (bundles / f"{model}.tpk").is_file()
        assert set(results["builds"][model]) == {"state", "aotpack"}
        assert all("error" not in b and b["seconds"] > 0 for b in results["builds"][model].values())
    assert results["weight_tensor_bytes"]["mlp"] == MLP_WEIGHT_BYTES

    rtol = tolerance("float16").rtol
    for model, io in (("mlp", MLP_IO), ("llama", LLAMA_IO)):
        runs = [r for r in results["runs"] if r["model"] == model]
        assert sorted((r["system"], r["run"]) for r in runs) == sorted(
            [("eager", "cold"), ("compile", "cold"), ("compile", "warm"), ("aotpack", "cold")]
        )
        for r in runs:
            assert r["error"] == "", (model, r["system"], r["error"])
            assert list(r["shapes"]) == list(io), (model, r["system"])
            assert r["cold_start_s"] > 0
            for shape, v in r["shapes"].items():
                assert v["median_ms"] > 0 and v["p90_ms"] >= v["median_ms"]
                assert (v["input_bytes"], v["output_bytes"]) == io[shape], (model, r["system"], shape)
                assert v["ref_scale"] > 0.1, f"{model} {shape}: eager's outputs are nearly zero"
                assert v["max_abs_err"] <= rtol * v["ref_scale"], (model, r["system"], shape, v)

    # the report puts the floor beside each row: (weights + inputs + outputs) / bandwidth
    text = report(results, tmp_path)
    bandwidth = results["device"]["bandwidth_bytes_per_s"]
    floor = (MLP_WEIGHT_BYTES + sum(MLP_IO["B=2"])) / bandwidth * 1e3
    cells = row(text, "mlp", "B=2")
    assert cells[2] == f"{floor:.3f}"
    aotpack = results["runs"][[(r["model"], r["system"]) for r in results["runs"]].index(("mlp", "aotpack"))]
    assert cells[-1] == f"{aotpack['shapes']['B=2']['median_ms'] / floor:.2f}"


def _results(gpu: str) -> dict:
    shapes = {"B=8 S=128": {"median_ms": 2.0, "p90_ms": 2.5, "input_bytes": 8192, "output_bytes": 65536000}}
    runs = [
        {
            "model": "llama",
            "system": s,
            "run": "warm" if s == "compile" else "cold",
            "error": "",
            "shapes": shapes,
        }
        for s in ("eager", "compile", "aotpack")
    ]
    return {
        "device": {
            "gpu": gpu,
            "nvidia_smi": "",
            "torch": "2.11",
            "triton": "3.6",
            "python": "3.12",
            "date": "-",
        },
        "import_torch_s": 3.0,
        "runs": runs,
        "weight_tensor_bytes": {"llama": 1_000_000_000},
        "weights_bytes": {"llama": 1_000_010_000},
        "builds": {"llama": {"aotpack": {"seconds": 40.0, "at_once": 3}}},
    }


@pytest.mark.parametrize("gpu, bandwidth", [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12)])
def test_report_floor_by_device_name(tmp_path, gpu, bandwidth):
    text = report(_results(gpu), tmp_path)
    floor = (1_000_000_000 + 8192 + 65536000) / bandwidth * 1e3
    cells = row(text, "llama", "B=8 S=128")
    assert cells[2] == f"{floor:.3f}"
    assert cells[-1] == f"{2.0 / floor:.2f}"
    assert f"({bandwidth / 1e12:.2f} TB/s)" in text
    assert "| llama | — | 40.0 s (3) |" in text  # the aotpack build, with how many ran at once


def test_report_floor_of_older_results(tmp_path):
    """Result files from before the worker recorded bytes: the model file says them."""
    results = _results("NVIDIA H200")
    for r in results["runs"]:
        r["model"] = "mlp"
        r["shapes"] = {"B=8": {"median_ms": 0.1, "p90_ms": 0.1}}
    results["weight_tensor_bytes"] = {}
    results["weights_bytes"] = {"mlp": MLP_WEIGHT_BYTES}
    results["builds"] = {}
    text = report(results, tmp_path)
    floor = (MLP_WEIGHT_BYTES + 2 * 8 * 1024 * 2) / 4.8e12 * 1e3
    assert row(text, "mlp", "B=8")[2] == f"{floor:.3f}"


def test_outputs_reach_the_host_as_they_are_without_a_device_copy():
    """``common.to_host``: a strided view (gpt's logits sliced from their padded GEMM) arrives
    with its values and strides; a contiguous one as ``.cpu()`` gives it."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from common import to_host

    wide = torch.randn(2, 3, 72)
    view = wide[..., :65]
    got = to_host(view)
    assert torch.equal(got, view) and got.stride() == view.stride()
    assert torch.equal(to_host(wide[0].t()), wide[0].t())
    assert to_host(torch.empty(0, 4)).shape == (0, 4)


def test_the_aotpack_rt_worker_gets_every_shapes_inputs_as_numpy(tmp_path):
    """``run.rt_worker``: the torch-free worker's inputs are ``common.make_inputs``' at each
    measured shape, in a NumPy file it reads without torch, and its command names them."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from common import SHAPES, make_inputs, shape_label
    from run import rt_worker

    cmd = rt_worker("mlp", tmp_path / "mlp-lf.tpk", tmp_path, 7, 3)
    assert cmd[0].endswith("worker_rt.py") and cmd[1] == "mlp"
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert args["--bundle"] == str(tmp_path / "mlp-lf.tpk") and (args["--calls"], args["--warmup"]) == (
        "7",
        "3",
    )
    assert json.loads(args["--labels"]) == [shape_label(s) for s in SHAPES["mlp"]]
    stored = np.load(args["--inputs"])
    for i, sizes in enumerate(SHAPES["mlp"]):
        for j, x in enumerate(make_inputs("mlp", sizes, "cpu")):
            np.testing.assert_array_equal(stored[f"{i}.{j}"], x.numpy())
    from safetensors.numpy import load_file

    first = load_file(args["--first"])  # the first shape's, by input name: read without numpy
    assert list(first) == ["x"]
    np.testing.assert_array_equal(first["x"], stored["0.0"])


def test_the_decode_bench_times_aotpack_rt_as_it_times_the_torch_loader(monkeypatch):
    """``decode.rt_row``: aotpack-rt's ms per token is the mean decode step between the first and
    the last token ``on_token`` saw (the torch loader rows' metric), and ``blocks_ms_per_token``
    the difference of two generations over the tokens between; on a stand-in runner whose prefill
    takes 2 ms, its first 8 decode steps 0.5 ms each and the rest 1 ms: (63 - 7) * 1 + 7 * 0.5
    over 63 steps, and (64 - 32) * 1 over 32."""
    sys.path.insert(0, str(ROOT / "bench"))
    import decode

    clock = [0.0]

    class Runner:
        def generate(self, prompts, n, on_token=None):
            clock[0] += 2e-3  # the prefill and the first token
            for step in range(n):
                if step:
                    clock[0] += 0.5e-3 if step <= 7 else 1e-3
                if on_token is not None:
                    on_token(step, [7] * len(prompts))
            return [[7] * n for _ in prompts]

    monkeypatch.setattr(decode.time, "perf_counter", lambda: clock[0])
    row = decode.rt_row(Runner(), {"batch": 2}, [[1, 2], [3]], 64)
    assert row["ms_per_token"] == pytest.approx((56 * 1 + 7 * 0.5) / 63)
    assert row["blocks_ms_per_token"] == pytest.approx(1.0)
    assert row["tokens_per_s"] == pytest.approx(2e3 / row["ms_per_token"]) and row["tokens"] == [7] * 16


def test_the_decode_profile_charges_each_kernel_with_how_far_it_moved_the_chains_end():
    """``decode.critical_path`` over four kernels in one stream (µs): b starts inside a's span
    and ends at 9 (charged 9 - 5), c starts after an idle gap and runs 2 (charged 2: the gap is
    no kernel's), the second a starts inside c and ends at 20 (charged 6); over two tokens 6 µs a
    token, and two of the three later kernels started before the one before them ended."""
    sys.path.insert(0, str(ROOT / "bench"))
    import decode

    table, overlapped = decode.critical_path([("a", 0, 5), ("c", 12, 14), ("b", 3, 9), ("a", 13, 20)], 2)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:4]}
    assert rows["a"][:3] == ["1", "3.00", "6.00"] and rows["b"][:3] == ["1", "2.00", "4.00"]
    assert rows["c"][:3] == ["1", "1.00", "2.00"]
    assert "charged 6.0 us a token over 4 kernels" in table and overlapped == pytest.approx(2 / 3)


def test_the_decode_bench_reuses_a_bundle_only_under_an_equal_build_key(monkeypatch, tmp_path):
    """``decode.build_key``: what a kept bundle was built from. It changes with a source file of the
    build, an ``AOTPACK_`` switch, the layers, the batch buckets, the archs and the context, and not
    with the environment's other variables; ``_kept`` takes a bundle only with its key beside it,
    and only that key."""
    sys.path.insert(0, str(ROOT / "bench"))
    import decode

    pytest.importorskip("transformers")
    for folder in decode.BUILD_CODE:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(decode, "ROOT", tmp_path)
    for name in [k for k in os.environ if k.startswith("AOTPACK_")] + [decode.LAYERS_ENV]:
        monkeypatch.delenv(name, raising=False)

    def key(**over):
        args = {"model": "gpt2", "tiny": True, "batches": (1, 2), "archs": ("sm_90",), "context": 32, **over}
        return decode.build_key(**args)

    base = key()
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    assert key() == base
    changed = [key(batches=(1, 8)), key(archs=("sm_80",)), key(context=160), key(model="llama")]
    monkeypatch.setenv(decode.LAYERS_ENV, "4")
    changed.append(key())
    monkeypatch.delenv(decode.LAYERS_ENV)
    monkeypatch.setenv("AOTPACK_DECODE_SPLIT", "4")
    changed.append(key())
    monkeypatch.delenv("AOTPACK_DECODE_SPLIT")
    assert key() == base
    (tmp_path / "codegen" / "a.py").write_text("x = 2\n")
    changed.append(key())
    assert len({base, *changed}) == 1 + len(changed)

    bundle = tmp_path / "gpt2-tiny.tpk"
    assert not decode._kept(bundle, base)  # no bundle
    bundle.write_bytes(b"bundle")
    assert not decode._kept(bundle, base)  # no key beside it: built by an older bench
    decode._keep(bundle, base)
    assert decode._kept(bundle, base) and not decode._kept(bundle, changed[0])


@pytest.mark.slow  # builds the example mlp
def test_bundle_paired_pairs_two_bundles_and_compares_their_outputs(tmp_path):
    """``bench/bundle_paired.py`` on the CPU (smoke shapes): one row per shape with both bundles'
    medians, the per-round ratios and their median, and the largest difference between the two
    bundles' outputs: 0 for one bundle against itself."""
    bundle, out = tmp_path / "mlp.tpk", tmp_path / "paired.json"
    env = {**os.environ, "AOTPACK_BENCH_SMOKE": "1"}
    build = [sys.executable, "-m", "aot.cli", "build", "-q", "models/mlp.py", "-o", str(bundle)]
    assert subprocess.run(build, cwd=ROOT, env=env, timeout=HANG_GUARD_S).returncode == 0
    paired = [sys.executable, "bench/bundle_paired.py", "mlp", str(bundle), str(bundle), "--device", "cpu"]
    done = subprocess.run(
        [*paired, "--rounds", "2", "--calls", "2", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["shape"] for r in rows] == ["B=1", "B=2"]
    for r in rows:
        assert r["max_abs_diff"] == 0.0
        assert len(r["b_over_a_rounds"]) == 2 and r["a_median_ms"] > 0 and r["b_median_ms"] > 0
        assert min(r["b_over_a_rounds"]) <= r["b_over_a_median_of_rounds"] <= max(r["b_over_a_rounds"])


@pytest.mark.slow  # a tiny GPT-2 traced and built
def test_decode_paired_times_two_decode_bundles_round_by_round(tmp_path):
    """``bench/decode_paired.py`` on the CPU (tiny GPT-2, one bundle against itself): each
    bundle's ms a token per round, their medians, B / A's median and the rounds B won; the
    tokens of every round checked against the first."""
    pytest.importorskip("transformers")
    bundles, out = tmp_path / "bundles", tmp_path / "paired.json"
    build = [sys.executable, "bench/decode.py", "--device", "cpu", "--tiny", "--models", "gpt2"]
    build += [
        "--systems",
        "aotpack",
        "--batches",
        "1",
        "--out",
        str(tmp_path / "res"),
        "--bundles",
        str(bundles),
    ]
    first = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert first.returncode == 0 and "traced gpt2" in first.stderr, first.stderr[-2000:]
    bundle = str(bundles / "gpt2-tiny.tpk")
    # the same code, switches and sizes again: the kept bundle is taken, nothing traced or written
    built_at = os.stat(bundle).st_mtime_ns
    again = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 0 and "traced" not in again.stderr, again.stderr[-2000:]
    assert f"reused {bundle}" in again.stderr and os.stat(bundle).st_mtime_ns == built_at
    assert json.loads((tmp_path / "res" / "decode.json").read_text())["rows"][0]["ms_per_token"] > 0
    paired = [sys.executable, "bench/decode_paired.py", "gpt2", bundle, bundle, "--device", "cpu", "--tiny"]
    done = subprocess.run(
        [*paired, "--rounds", "3", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["rounds"] == 3 and all(len(result["per_round"][n]) == 3 for n in "ab")
    ratios = [b / a for a, b in zip(result["per_round"]["a"], result["per_round"]["b"])]
    assert min(ratios) <= result["b_over_a"] <= max(ratios)
    assert 0 <= result["b_faster_rounds"] <= 3 and all(v > 0 for v in result["ms_per_token"].values())
    assert "b faster in" in done.stdout
    assert result["tokens_equal"] and result["tokens_part_at_step"] is None


def test_decode_paired_says_where_two_bundles_tokens_part():
    """``--tokens-may-differ`` times bundles whose greedy tokens part; the step where any row's
    tokens first differ (or one row ends sooner) is reported."""
    from bench.decode_paired import first_difference

    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) is None
    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == 1
    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 7, 3], [4, 5, 0]]) == 1
    assert first_difference([[1, 2, 3]], [[1, 2]]) == 2


def test_decode_paired_scores_each_bundles_tokens_by_the_model_in_float32():
    """``--score``: the model's own greedy tokens are float32's choice at every step (gap 0); a
    token changed at one step is off float32's choice there, by the logits' difference."""
    pytest.importorskip("transformers")
    import torch

    from bench.decode import make_model, prompts
    from bench.decode_paired import float32_gaps, score

    module = make_model("gpt2", True, torch.float32, "cpu")
    ids = prompts(2, 5, module.config.vocab_size)
    with torch.no_grad():
        out = module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    greedy = out[:, ids.shape[1] :].tolist()
    assert all(g == 0.0 for row in float32_gaps(module, ids.tolist(), greedy) for g in row)
    changed = [row[:] for row in greedy]
    changed[1][2] = (changed[1][2] + 1) % module.config.vocab_size
    with torch.no_grad():
        logits = module(torch.tensor([ids[1].tolist() + greedy[1][:2]])).logits[0, -1]
    want_gap = (logits.max() - logits[changed[1][2]]).item()
    scored = score(module, ids.tolist(), {"a": greedy, "b": changed})
    assert scored["a"] == {"steps": 8, "steps_off_float32": 0, "largest_gap": 0.0, "mean_gap_off": 0.0}
    b = scored["b"]
    assert b["steps"] == 8 and b["steps_off_float32"] >= 1 and b["largest_gap"] >= want_gap - 1e-4
    # the change's own step: float32's best less the changed token's logit
    assert float32_gaps(module, ids.tolist(), changed)[1][2] == pytest.approx(want_gap, abs=1e-4)
