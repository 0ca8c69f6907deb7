"""What the Triton serving path finds on this machine, and whether Triton's Python backend works here.

    python3 bench/serve_env.py report                 # interpreter, versions, tritonserver, libpython
    python3 bench/serve_env.py probe --json probe.json
    python3 bench/serve_env.py wheels FOLDER          # FOLDER's wheels this Python lacks or has older
    python3 bench/serve_env.py overlay DIR FOLDER... --wheels W  # a venv: W's wheels, then FOLDERs, then ours

``report`` names what the stub will embed and link: the interpreter and the first ``python3`` on
PATH (the stub's embedded Python takes that one's prefix and site-packages), the versions that
matter, nvidia-pytriton's tritonserver and stub, and where ``libpython3.X.so.1.0`` is (the stub
links it and cannot start without it): ``sysconfig``'s LIBDIR, ``ldconfig -p``, the usual folders,
``python3.X-config --ldflags``, and ``ldd`` of the stub under tritonserver's LD_LIBRARY_PATH.

``probe`` starts tritonserver (``aot.serve.triton``) on one Python-backend model that reports the
stub's interpreter, numpy and torch, runs ``check_numpy_bridge`` without raising, and answers
``2 * x``; one KServe v2 request over HTTP (urllib: no tritonclient needed) checks the answer. Exit
status 0: the stub works; 3: it starts but moves tensor bytes wrongly (numpy 2 under
nvidia-pytriton 0.7's stubs); 1: the server or the model did not start (see ``report``).

``wheels`` prints the wheels of FOLDER to install here: those whose distribution this Python lacks
or has at an older version (run it without PYTHONPATH to ask about the image alone).

``overlay`` makes the environment to serve from when this Python's numpy breaks the stub: the stub
ignores PYTHONPATH and reads the site-packages of the first ``python3`` on PATH, so numpy<2 must sit
in a venv of its own (``--wheels``: installed into DIR/lib/python3.X/site-packages), whose ``.pth``
file then adds FOLDERs and this interpreter's site folders behind it (their ``.pth`` files count, so an
editable aotpack install is found). Run everything from ``DIR/bin/python3``; ``aot.serve`` puts its
folder first on tritonserver's PATH.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import urllib.request
from pathlib import Path

DISTRIBUTIONS = (
    "aotpack",
    "nvidia-pytriton",
    "tritonclient",
    "numpy",
    "grpcio",
    "protobuf",
    "zstandard",
    "safetensors",
    "click",
    "ml-dtypes",
    "python-rapidjson",
    "gevent",
    "pytest",
)
LIB_FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
PROBE_TIMEOUT_S = 180.0

PROBE_CONFIG = """name: "probe"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

PROBE_MODEL_PY = '''"""bench/serve_env.py probe: what the stub's interpreter sees, and a 2 * x answer."""

import json
import os
import site
import sys

for _folder in filter(None, os.environ.get("AOTPACK_SITE_DIRS", "").split(os.pathsep)):
    site.addsitedir(_folder)

import numpy as np  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb

        self.pb = pb
        seen = {"executable": sys.executable, "prefix": sys.prefix, "isolated": sys.flags.isolated,
                "numpy": np.__version__, "numpy_file": np.__file__}
        try:
            from aot.serve.triton_model import check_numpy_bridge

            check_numpy_bridge(pb)
            seen["bridge"] = "ok"
        except Exception as e:
            seen["bridge"] = f"{type(e).__name__}: {e}"
        try:
            import torch

            seen["torch"] = torch.__version__
            seen["cuda"] = torch.cuda.is_available()
        except Exception as e:
            seen["torch"] = f"{type(e).__name__}: {e}"
        print("PROBE " + json.dumps(seen), flush=True)

    def execute(self, requests):
        pb = self.pb
        answers = []
        for request in requests:
            x = pb.get_input_tensor_by_name(request, "x").as_numpy()
            y = (x * 2).astype(np.float32)
            answers.append(pb.InferenceResponse(output_tensors=[pb.Tensor("y", y)]))
        return answers
'''


def _run(cmd: list[str], env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({cmd[0]}: {type(e).__name__}: {e})"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def report() -> int:
    print("python", sys.version.split()[0], sys.executable, "base", getattr(sys, "_base_executable", "?"))
    print("prefix", sys.prefix, "base_prefix", sys.base_prefix)
    print("first python3 on PATH", shutil.which("python3"))
    print("PYTHONPATH", os.environ.get("PYTHONPATH", "-"))
    for name in DISTRIBUTIONS:
        print(f"  {name} {_version(name)}")
    try:
        import numpy

        print("numpy imported", numpy.__version__, numpy.__file__)
    except Exception as e:
        print("numpy import failed:", type(e).__name__, e)
    try:
        import torch

        cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        print("torch", torch.__version__, "cuda", torch.version.cuda, cuda)
    except Exception as e:
        print("torch import failed:", type(e).__name__, e)

    from aot.errors import EnvError
    from aot.serve.triton import find_tritonserver, server_env

    try:
        dist = find_tritonserver()
    except EnvError as e:
        print("tritonserver: MISSING:", e)
        return 1
    print("tritonserver", dist.server)
    print("stub", dist.stub)
    soname = (
        sysconfig.get_config_var("INSTSONAME")
        or f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0"
    )
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    print(
        "libpython wanted:",
        soname,
        "| sysconfig LIBDIR",
        libdir,
        "| LDLIBRARY",
        sysconfig.get_config_var("LDLIBRARY"),
    )
    print("  in LIBDIR:", os.path.exists(os.path.join(libdir, soname)))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    ldconfig = [
        line.strip() for line in _run(["ldconfig", "-p"]).splitlines() if f"libpython{version}" in line
    ]
    print("  ldconfig -p:", ldconfig or "none")
    found = sorted({p for folder in LIB_FOLDERS for p in glob.glob(f"{folder}/libpython{version}*.so*")})
    print("  in", ", ".join(LIB_FOLDERS) + ":", found or "none")
    print(f"  python{version}-config --ldflags:", _run([f"python{version}-config", "--ldflags"]))
    env = server_env(dist)
    print("  tritonserver's LD_LIBRARY_PATH:", env["LD_LIBRARY_PATH"])
    links = _run(["ldd", str(dist.stub)], env={**os.environ, "LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
    line = next((x.strip() for x in links.splitlines() if "libpython" in x), links[-300:])
    print("  ldd stub:", line)
    if "not found" in line or "=>" not in line:
        print(
            f"libpython: MISSING: the stub links {soname} and cannot start without it; install this "
            f"Python's shared library (Ubuntu: libpython{version}t64, or python{version}-dev) or put "
            "the folder holding it first in LD_LIBRARY_PATH"
        )
        return 1
    print("libpython: found", line.split("=>")[1].split("(")[0].strip())
    return 0


def probe(json_path: str | None, timeout: float) -> int:
    from serve_load import free_ports  # bench/ is on sys.path as the script's folder

    from aot.errors import EnvError
    from aot.serve.triton import TritonServer

    result: dict = {"python": sys.executable}
    with tempfile.TemporaryDirectory(prefix="serve-probe-") as tmp:
        repo = Path(tmp)
        (repo / "probe" / "1").mkdir(parents=True)
        (repo / "probe" / "config.pbtxt").write_text(PROBE_CONFIG)
        (repo / "probe" / "1" / "model.py").write_text(PROBE_MODEL_PY)
        http, grpc, metrics = free_ports(3)
        server = TritonServer(repo, "probe", http, grpc, metrics, "127.0.0.1", drain_timeout=5)
        try:
            server.start(timeout=timeout)
            body = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
            request = urllib.request.Request(
                f"{server.url}/v2/models/probe/infer",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                result["answer"] = json.loads(answer.read())["outputs"][0]["data"]
        except (EnvError, OSError, KeyError, ValueError) as e:
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            result["stopped"] = server.stop() if server.process is not None else None
            log = list(server.log)
    for line in log:
        if "PROBE " in line:
            result["stub"] = json.loads(line.split("PROBE ", 1)[1])
        elif "server_version" in line:
            result["tritonserver"] = line.strip(" |").split("|")[-1].strip()
    stub = result.get("stub", {})
    if not stub:
        result["verdict"] = "the server or the model did not start"
        result["log_tail"] = log[-15:]
        code = 1
    elif stub.get("bridge") != "ok":
        result["verdict"] = f"the stub moves tensor bytes wrongly under numpy {stub.get('numpy')}"
        code = 3
    elif result.get("answer") != [2.0, 4.0, 6.0, 8.0]:
        result["verdict"] = "the model loaded but did not answer 2 * [1, 2, 3, 4]"
        result["log_tail"] = log[-15:]
        code = 1
    else:
        result["verdict"] = f"the stub works (numpy {stub.get('numpy')}, torch {stub.get('torch')})"
        code = 0
    print(json.dumps(result, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return code


def wheels(folder: str) -> int:
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    for path in sorted(Path(folder).glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        have = _version(name)
        if have != "-" and Version(have) >= version:
            print(f"keep {canonicalize_name(name)} {have} (carried {version})", file=sys.stderr)
            continue
        print(f"install {canonicalize_name(name)} {version} (here: {have})", file=sys.stderr)
        print(path)
    return 0


def overlay(target: str, folders: list[str], wheel_folder: str | None) -> int:
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(target)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    own = Path(target) / "lib" / f"python{version}" / "site-packages"
    if wheel_folder:
        given = sorted(str(p) for p in Path(wheel_folder).glob("*.whl"))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--no-cache-dir", "--target", str(own), *given], check=True)
        print("installed", ", ".join(Path(g).name for g in given))
    behind = [os.path.abspath(f) for f in folders] + list(site.getsitepackages())
    lines = "; ".join(f"site.addsitedir({d!r})" for d in dict.fromkeys(behind) if os.path.isdir(d))
    (own / "aotpack-overlay.pth").write_text(f"import site; {lines}\n")
    print(f"{target}/bin/python3: {own}, then {', '.join(behind)}")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("report")
    p = sub.add_parser("probe")
    p.add_argument("--json")
    p.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S)
    w = sub.add_parser("wheels")
    w.add_argument("folder")
    o = sub.add_parser("overlay")
    o.add_argument("target")
    o.add_argument("folders", nargs="*")
    o.add_argument("--wheels", help="install these wheels into the venv's own site-packages")
    args = ap.parse_args()
    if args.verb == "report":
        sys.exit(report())
    if args.verb == "probe":
        sys.exit(probe(args.json, args.timeout))
    if args.verb == "wheels":
        sys.exit(wheels(args.folder))
    sys.exit(overlay(args.target, args.folders, args.wheels))


if __name__ == "__main__":
    main()
