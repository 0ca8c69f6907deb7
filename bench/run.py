"""Benchmark driver: every system in its own fresh process, on one GPU, in one run.

    python bench/run.py --models mlp,cnn --bundles .bundles --out OUT_DIR

Writes OUT_DIR/results-<models>.json after every measurement (a timeout keeps what was done);
``bench/report.py`` turns result files into RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("eager", "graph", "compile", "reduce-overhead", "aoti", "aotpack", "aotpack-borrow")
TIMEOUT = 300


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
        return None, (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return json.loads(lines[-1]), ""


def import_torch_floor() -> float:
    times = []
    for _ in range(3):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.time() - t0)
    return sorted(times)[1]


def device_info() -> dict:
    import torch
    import triton

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "gpu": torch.cuda.get_device_name(),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,cnn")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--bundles", default=".bundles")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    results: dict = {"device": device_info(), "import_torch_s": import_torch_floor(), "runs": []}
    path = out / f"results-{'-'.join(models)}.json"
    work = Path(tempfile.mkdtemp(prefix="aotbench-"))

    def save():
        path.write_text(json.dumps(results, indent=1))

    for model in models:
        bundle = Path(args.bundles) / f"{model}.tpk"
        weights = next(Path(args.bundles).glob(f"{model}.weights.*.safetensors"))
        results.setdefault("bundle_bytes", {})[model] = bundle.stat().st_size + weights.stat().st_size
        results.setdefault("weights_bytes", {})[model] = weights.stat().st_size
        for system in args.systems.split(","):
            base = [
                "bench/worker.py",
                system,
                model,
                "--spawned-at",
                "0",
                "--weights",
                str(weights),
                "--out",
                str(work),
            ]
            runs = []
            if system in ("compile", "reduce-overhead"):
                cache = work / f"cache-{model}-{system}"
                env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
                for label in ("cold", "warm"):
                    r, err = spawn(base, env)
                    runs.append((label, r, err))
            elif system == "aoti":
                package = work / f"{model}.pt2"
                b, err = spawn(
                    ["bench/aoti_build.py", model, "--weights", str(weights), "--package", str(package)],
                    timeout=400,
                )
                if b is None:
                    runs.append(("build", None, err))
                else:
                    preload = subprocess.run(
                        ["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True
                    ).stdout.strip()
                    r, err = spawn(
                        [*base, "--package", str(package)], {"LD_PRELOAD": preload} if preload else {}
                    )
                    if r is not None:
                        r["build_s"] = b["build_s"]
                        r["artifact_bytes"] = package.stat().st_size
                    runs.append(("cold", r, err))
            else:
                extra = ["--bundle", str(bundle)] if system.startswith("aotpack") else []
                r, err = spawn([*base, *extra])
                runs.append(("cold", r, err))
            for label, r, err in runs:
                entry = {"model": model, "system": system, "run": label, "error": err}
                if r is not None:
                    entry.update(r)
                results["runs"].append(entry)
                print(
                    f"{model:4} {system:16} {label:5} "
                    + (
                        f"cold {r['cold_start_s']:.1f}s "
                        + " ".join(f"{k}: {v['median_ms']:.3f}ms" for k, v in r["shapes"].items())
                        + f" device {r['device_mem_mb']:.0f} MiB, peak alloc {r['peak_alloc_mb']:.0f} MiB"
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
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
