"""Benchmark driver: every system in its own fresh process, on one device, in one run.

    python bench/run.py --models mlp,cnn --bundles .bundles --out OUT_DIR
    python bench/run.py --models llama,resnet50,convnext_tiny --out OUT_DIR   # builds what is missing
    python bench/run.py --device cpu --smoke --models mlp,llama --bundles B --out OUT_DIR

First, before anything is timed, the files each model's systems load are made where missing
(in ``--bundles``, up to ``--jobs`` at a time: they use the CPU, and their seconds are recorded
with how many ran at once):

- ``MODEL.state.safetensors``: the model file's seeded module (``bench/state_dict.py``), the
  weights every system but aotpack loads, and every bundle built here is built from;
- ``MODEL.tpk``: ``aotpack build --split-weights --arch <this device's> --weights STATE``; a
  prebuilt one (an example model's, from a CPU box) holds the same seeded weights, its split
  weights re-created and checked against its sha256 by ``bench/device_setup.sh``;
- ``MODEL-gemm.tpk`` (for aotpack-tuned): the same build with ``--gemm-candidates`` (its weights
  file differs from ``MODEL.tpk``'s: with candidates the build leaves sibling matmuls apart, for
  tune to choose between library GEMMs and fused candidates, where without it stacks them);
- ``MODEL.pt2`` (for aoti, in a scratch folder): ``bench/aoti_build.py``;
- ``MODEL-lf.tpk`` (for ``aotpack-rt`` and ``aotpack-lf``): ``aotpack build --library-free``, the
  weights inside. ``aotpack-rt`` runs it on the runtime without torch (``bench/worker_rt.py``: a
  process that never imports torch, its inputs written beforehand as NumPy arrays), ``aotpack-lf``
  on the torch loader: the two side by side on the same bundle. Neither is in the default systems:
  ``--systems aotpack,aotpack-lf,aotpack-rt``.

Then per model: ``aotpack tune`` of the GEMM bundle at the measured shapes only (at every bucket
for ``TUNE_EVERY_BUCKET``; alone on the GPU, into ``MODEL-tuned.tpk`` beside the weights it shares), then each system in a fresh process.
Every system's outputs are compared with eager's at the end (``max_abs_err``): one that ran other
weights would show there. Writes OUT_DIR/results-<models>.json after every measurement (a
timeout keeps what was done); ``bench/report.py`` turns result files into RESULTS.md.

``--smoke`` (``AOTPACK_BENCH_SMOKE=1`` for every process) checks the harness on a CPU: tiny
shapes, a few calls, tiny real-model configs, the systems that run there (eager, compile, aotpack).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = (
    "eager",
    "graph",
    "compile",
    "reduce-overhead",
    "aoti",
    "aotpack",
    "aotpack-tuned",
    "aotpack-borrow",
)
CPU_SYSTEMS = ("eager", "compile", "aotpack")
LIBRARY_FREE_SYSTEMS = ("aotpack-rt", "aotpack-lf")  # on MODEL-lf.tpk; asked for by --systems
TIMEOUT = 300  # seconds one worker may take
BUILD_TIMEOUT = 400  # seconds one build may take
TUNE_REPEATS = 50  # timed CUDA-graph replays per GEMM form (aotpack tune's default)
# tuned at every bucket (a few seconds each), so tune may find a plan without cuBLAS, which needs
# every bucket (verify/tune.py); the others only at the shapes measured
TUNE_EVERY_BUCKET = ("mlp", "cnn", "resnet50", "convnext_tiny")
JOBS = 4  # builds at once: each is mostly one core (tracing) or its own worker pool (compiling)


def spawn(args: list[str], env: dict | None = None, timeout: int = TIMEOUT) -> tuple[dict | None, str]:
    start = time.time()
    cmd = [sys.executable, *args]
    if "--spawned-at" in args:
        cmd[cmd.index("--spawned-at") + 1] = repr(start)
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return None, _last_line(p)
    return json.loads(lines[-1]), ""


def _last_line(p: subprocess.CompletedProcess) -> str:
    """What went wrong, in one line: the last exception line of stderr, else its last line."""
    lines = (p.stderr or "").strip().splitlines() or (p.stdout or "").strip().splitlines() or ["no output"]
    errors = [ln for ln in lines if ln and not ln[0].isspace() and ("Error" in ln or "Exception" in ln)]
    return (errors or lines)[-1][:300]


def timed_command(cmd: list[str], timeout: int = BUILD_TIMEOUT, log: Path | None = None) -> dict:
    """Run a build step; its wall seconds, or why it failed (its whole output into ``log``)."""
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    if log is not None:
        log.write_text(p.stdout + p.stderr)
    record = {"seconds": time.time() - start}
    if p.returncode != 0:
        record["error"] = _last_line(p)
    elif p.stdout.strip():
        record["said"] = p.stdout.strip().splitlines()[-1][:300]
    return record


def import_torch_floor() -> float:
    times = []
    for _ in range(3):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.time() - t0)
    return sorted(times)[1]


def device_info(device: str) -> dict:
    import torch
    import triton

    sys.path.insert(0, str(HERE))
    from decode import bandwidth_of

    info = {
        "gpu": "cpu",
        "nvidia_smi": "",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
        "bandwidth_bytes_per_s": bandwidth_of(device, None),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    return info


def device_arch(device: str) -> str:
    """The arch the bundles built here compile for: this GPU's, or sm_90 on a CPU run."""
    if not device.startswith("cuda"):
        return "sm_90"
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def split_weights(bundle: Path) -> Path:
    """The split weights file beside ``bundle``, as its manifest names it."""
    from aot.bundle import open_bundle

    opened = open_bundle(bundle)
    try:
        return opened.external_path()
    finally:
        opened.close()


def tensor_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file (its header excluded)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def prepare(models: list[str], systems: list[str], bundles: Path, work: Path, device: str, jobs: int) -> dict:
    """Per model: the files its systems load, made where missing (see the module docstring), as
    {model: {"weights", "bundle", "gemm", "package": paths, "builds": {step: record}}}."""
    from common import load_spec, model_file

    arch = device_arch(device)
    aotpack = [sys.executable, "-m", "aot.cli", "build", "--split-weights", "--arch", arch, "-q"]
    plan: dict = {}
    states, builds = [], []  # (model, step, command): states first, every build may read one
    for model in models:
        load_spec(model)  # a broken model file fails here, not after minutes of building
        source = str(model_file(model))
        bundle, state = bundles / f"{model}.tpk", bundles / f"{model}.state.safetensors"
        p = plan[model] = {"bundle": bundle, "gemm": bundles / f"{model}-gemm.tpk", "builds": {}}
        p["free"] = bundles / f"{model}-lf.tpk"
        if set(LIBRARY_FREE_SYSTEMS) & set(systems) and not current(p["free"]):
            free = [*aotpack[:4], "--arch", arch, "-q", source, "-o", str(p["free"]), "--library-free"]
            builds.append((model, "aotpack-lf", [*free, "--weights", str(state)]))  # weights inside
        p["package"] = work / f"{model}.pt2"
        p["weights"] = state
        if not state.exists():
            states.append((model, "state", [sys.executable, str(HERE / "state_dict.py"), source, str(state)]))
        if not bundle.exists():
            builds.append((model, "aotpack", [*aotpack, source, "-o", str(bundle), "--weights", str(state)]))
        if "aotpack-tuned" in systems and not p["gemm"].exists():
            gemm = [*aotpack, source, "-o", str(p["gemm"]), "--gemm-candidates", "--weights", str(state)]
            builds.append((model, "aotpack-gemm", gemm))
        if "aoti" in systems:
            aoti = [str(HERE / "aoti_build.py"), model, "--weights", str(p["weights"]), "--device", device]
            builds.append((model, "aoti", [sys.executable, *aoti, "--package", str(p["package"])]))
    builds.sort(key=lambda step: step[1] != "aoti")  # the longest first
    for wave in (states, builds):
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            records = list(pool.map(lambda step: timed_command(step[2]), wave))
        for (model, step, _), record in zip(wave, records):
            record["at_once"] = min(jobs, len(wave))  # at most; fewer once the others are done
            plan[model]["builds"][step] = record
            took = f"ERROR {record['error']}" if "error" in record else f"{record['seconds']:.1f}s"
            print(f"{model:13} build {step:12} {took} (up to {record['at_once']} at once)", flush=True)
    return plan


def current(bundle: Path) -> bool:
    """``bundle`` exists and is of this aotpack's schema: a library-free bundle built before
    (schema 1.10: its weights' one sha256, checked on one thread) is built again."""
    import zipfile

    from aot.schema import SCHEMA_VERSION

    if not bundle.exists():
        return False
    try:
        with zipfile.ZipFile(bundle) as zf:
            return tuple(json.loads(zf.read("manifest.json"))["schema_version"]) == SCHEMA_VERSION
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError):
        return False


def compile_runtime() -> None:
    """Byte-compile the runtime's sources (``aot/``, ``runtime/``), as ``pip install`` of its wheel
    does: without it an interpreter that may not write bytecode (``PYTHONDONTWRITEBYTECODE``, a
    read-only tree) compiles ~30 modules from source at every start, which the cold start would
    then count (~0.1 s on a 2-core box)."""
    root = HERE.parent
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(root / "aot"), str(root / "runtime")], check=True
    )


def rt_worker(model: str, bundle: Path, work: Path, calls: int, warmup: int) -> list[str]:
    """The ``aotpack-rt`` worker's command line, its inputs (every measured shape's, made as
    ``bench/worker.py`` makes them) written first to ``work/MODEL.inputs.npz``."""
    import numpy as np
    from common import SHAPES, load_spec, make_inputs, shape_label
    from safetensors.numpy import save_file

    arrays = {}
    for i, sizes in enumerate(SHAPES[model]):
        for j, x in enumerate(make_inputs(model, sizes, "cpu")):
            arrays[f"{i}.{j}"] = x.numpy()
    path = work / f"{model}.inputs.npz"
    np.savez(path, **arrays)
    # the first shape's also by input name: the worker's first call reads it without numpy
    names = [inp.name for inp in load_spec(model).inputs]
    first = work / f"{model}.first.safetensors"
    save_file({name: arrays[f"0.{j}"] for j, name in enumerate(names)}, str(first))
    labels = json.dumps([shape_label(s) for s in SHAPES[model]])
    return [
        str(HERE / "worker_rt.py"), model, "--spawned-at", "0", "--bundle", str(bundle), "--inputs", str(path),
        "--first", str(first),
        "--labels", labels, "--out", str(work), "--calls", str(calls), "--warmup", str(warmup),
    ]  # fmt: skip


def tune(model: str, gemm: Path, tuned: Path, shapes: list[dict[str, int]], out: Path) -> dict:
    """``aotpack tune`` of ``gemm`` at ``shapes`` only, into ``tuned`` (beside the weights it shares);
    what it said per site and bucket into ``out/tune-MODEL.log``, its whole-program checks printed."""
    buckets = [a for sizes in shapes for a in ("--bucket", ",".join(f"{k}={v}" for k, v in sizes.items()))]
    if model in TUNE_EVERY_BUCKET:
        buckets = []
    cmd = [sys.executable, "-m", "aot.cli", "tune", str(gemm), "-o", str(tuned)]
    cmd += ["--repeats", str(TUNE_REPEATS)]
    log = out / f"tune-{model}.log"
    record = timed_command([*cmd, *buckets], log=log)
    took = f"ERROR {record['error']}" if "error" in record else f"{record['seconds']:.1f}s"
    print(f"{model:13} tune  {took}", flush=True)
    for line in log.read_text().splitlines() if log.exists() else ():
        if "whole program" in line or "library-free" in line:
            print(f"{model:13} tune {line.strip()}", flush=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,cnn")
    ap.add_argument("--systems", help=f"[default: {','.join(SYSTEMS)}; on a CPU {','.join(CPU_SYSTEMS)}]")
    ap.add_argument("--bundles", default=".bundles")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda or cpu [default: cuda]")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and configs, a few calls: the harness")
    ap.add_argument("--jobs", type=int, default=JOBS, help=f"builds at once [default: {JOBS}]")
    args = ap.parse_args()
    if args.smoke:
        os.environ["AOTPACK_BENCH_SMOKE"] = "1"  # before common is imported; every child inherits it
    sys.path.insert(0, str(HERE))
    from common import CALLS, SHAPES, WARMUP

    out, bundles = Path(args.out), Path(args.bundles)
    out.mkdir(parents=True, exist_ok=True)
    bundles.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    systems = (args.systems or ",".join(SYSTEMS if args.device.startswith("cuda") else CPU_SYSTEMS)).split(
        ","
    )
    results: dict = {
        "device": device_info(args.device),
        "import_torch_s": import_torch_floor(),
        "smoke": args.smoke,
        "calls": CALLS,
        "warmup": WARMUP,
        "runs": [],
    }
    path = out / f"results-{'-'.join(models)}.json"
    work = Path(tempfile.mkdtemp(prefix="aotbench-"))

    def save():
        path.write_text(json.dumps(results, indent=1))

    plan = prepare(models, systems, bundles, work, args.device, args.jobs)
    for model in models:
        p = plan[model]
        builds = results.setdefault("builds", {})[model] = {k: dict(v) for k, v in p["builds"].items()}
        if p["bundle"].exists():
            weights = split_weights(p["bundle"])
            results.setdefault("bundle_bytes", {})[model] = (
                p["bundle"].stat().st_size + weights.stat().st_size
            )
            results.setdefault("weights_bytes", {})[model] = weights.stat().st_size
            # the weights a call must read at least once: the bundle's (tied ones stored once)
            results.setdefault("weight_tensor_bytes", {})[model] = tensor_bytes(weights)
        tuned, why_not_tuned = bundles / f"{model}-tuned.tpk", ""
        if "aotpack-tuned" in systems:
            if not p["gemm"].exists():
                why_not_tuned = "no bundle: " + builds.get("aotpack-gemm", {}).get("error", "")
            else:
                builds["tune"] = tune(model, p["gemm"], tuned, SHAPES[model], out)
                why_not_tuned = builds["tune"].get("error", "")
        for system in systems:
            worker = [str(HERE / "worker.py"), system, model, "--spawned-at", "0"]
            base = [*worker, "--weights", str(p["weights"]), "--out", str(work), "--device", args.device]
            runs = []
            if system in ("compile", "reduce-overhead"):
                cache = work / f"cache-{model}-{system}"
                env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
                for label in ("cold", "warm"):
                    r, err = spawn(base, env)
                    runs.append((label, r, err))
            elif system == "aoti":
                if "error" in builds["aoti"]:
                    runs.append(("build", None, builds["aoti"]["error"]))
                else:
                    preload = subprocess.run(
                        ["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True
                    ).stdout.strip()
                    r, err = spawn(
                        [*base, "--package", str(p["package"])], {"LD_PRELOAD": preload} if preload else {}
                    )
                    if r is not None:
                        r["build_s"] = builds["aoti"]["seconds"]
                        r["artifact_bytes"] = p["package"].stat().st_size
                    runs.append(("cold", r, err))
            elif system == "aotpack-rt":
                if not p["free"].exists():
                    r, err = None, "no bundle: " + builds.get("aotpack-lf", {}).get("error", "")
                else:
                    compile_runtime()
                    r, err = spawn(rt_worker(model, p["free"], work, CALLS, WARMUP))
                if r is not None and "aotpack-lf" in builds:
                    r["build_s"] = builds["aotpack-lf"]["seconds"]
                runs.append(("cold", r, err))
            elif system.startswith("aotpack"):
                bundle = {"aotpack-tuned": tuned, "aotpack-lf": p["free"]}.get(system, p["bundle"])
                if system == "aotpack-tuned" and why_not_tuned:
                    r, err = None, why_not_tuned
                elif not bundle.exists():
                    step = "aotpack-lf" if system == "aotpack-lf" else "aotpack"
                    r, err = None, "no bundle: " + builds.get(step, {}).get("error", "")
                else:
                    r, err = spawn([*base, "--bundle", str(bundle)])
                if r is not None and system == "aotpack" and "aotpack" in builds:
                    r["build_s"] = builds["aotpack"]["seconds"]
                if r is not None and system == "aotpack-tuned":
                    r["build_s"] = builds.get("aotpack-gemm", {}).get("seconds")
                    r["tune_s"] = builds["tune"]["seconds"]
                runs.append(("cold", r, err))
            else:
                r, err = spawn(base)
                runs.append(("cold", r, err))
            for label, r, err in runs:
                entry = {"model": model, "system": system, "run": label, "error": err}
                if r is not None:
                    entry.update(r)
                results["runs"].append(entry)
                memory = (
                    f" device {r['device_mem_mb']:.0f} MiB"
                    + (f", peak alloc {r['peak_alloc_mb']:.0f} MiB" if "peak_alloc_mb" in r else "")
                    + (
                        f" (weights {r['weights_mb']:.0f} + arena {r['arena_mb']:.0f} MiB)"
                        if "weights_mb" in r and "arena_mb" in r
                        else ""
                    )
                    if r and "device_mem_mb" in r
                    else ""
                )
                if r and "cold_start_phases_s" in r:  # aotpack-rt: where the cold start went
                    memory += " cold phases: " + " ".join(
                        f"{k} {v:.3f}s" for k, v in r["cold_start_phases_s"].items()
                    )
                print(
                    f"{model:13} {system:16} {label:5} "
                    + (
                        f"cold {r['cold_start_s']:.1f}s "
                        + " ".join(f"{k}: {v['median_ms']:.3f}ms" for k, v in r["shapes"].items())
                        + memory
                        if r
                        else f"ERROR {err}"
                    ),
                    flush=True,
                )
                save()
        # accuracy: every system's outputs against eager's
        from safetensors.torch import load_file

        ref_path = work / f"{model}.eager.safetensors"
        if ref_path.exists():
            ref = load_file(str(ref_path))
            for entry in results["runs"]:
                f = work / f"{model}.{entry['system']}.safetensors"
                if entry["model"] == model and "shapes" in entry and f.exists():
                    got = load_file(str(f))
                    for k, v in entry["shapes"].items():
                        v["max_abs_err"] = (got[k] - ref[k]).abs().max().item()
                        v["ref_scale"] = ref[k].abs().max().item()
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
