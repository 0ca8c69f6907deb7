#!/usr/bin/env bash
# Stage here (with network) what the GPU machine needs to serve bundles on Triton, as two carries of at
# most 64 MiB each with the working tree (bench/device_serve.sh says how the two calls use them):
#   .whl-serve1/         nvidia-pytriton (tritonserver and its Python backend, 55 MB) and zstandard
#   .whl-serve2/         what tritonclient[grpc,http] and nvidia-pytriton need that the GPU image lacks,
#                        plus grpcio and protobuf (tritonclient's generated code needs grpcio>=1.81.1 and
#                        protobuf>=6.33.5; installed there only where the image's are older)
#   .whl-serve2/numpy1/  numpy 1.26 (nvidia-pytriton's stubs need numpy<2; the image has numpy 2)
#   .bundles/            mlp.tpk and gpt.tpk for sm_90 without their split weights (bench/device_setup.sh
#                        re-creates those there from the seeded model files)
# Knobs: PYVER (3.12, the GPU image's Python; 3.11 to try bench/device_serve.sh on a CPU box here),
# WHEELS1, WHEELS2, BUNDLES (folders), MODELS (mlp,gpt: the bundles to build; empty for none).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHEELS1=${WHEELS1:-.whl-serve1} WHEELS2=${WHEELS2:-.whl-serve2} BUNDLES=${BUNDLES:-.bundles}
MODELS=${MODELS-mlp,gpt}
PYTRITON=nvidia-pytriton==0.7.0 TRITONCLIENT='tritonclient[grpc,http]==2.73.0'
ZSTANDARD=zstandard==0.25.0 NUMPY1=numpy==1.26.4
LIMIT=$((64 * 1024 * 1024))

ALL=$(mktemp -d)
trap 'rm -rf "$ALL"' EXIT
# One resolve for the GPU image's Python and platform, so every distribution comes in one version.
python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$ALL" "$PYTRITON" "$TRITONCLIENT" "$ZSTANDARD" "$NUMPY1"

rm -rf "$WHEELS1" "$WHEELS2"
mkdir -p "$WHEELS1" "$WHEELS2/numpy1"
python3 - "$ALL" "$WHEELS1" "$WHEELS2" "$PYVER" <<'PY'
"""Walk the requirements from pytriton, tritonclient[grpc,http] and zstandard, stopping at what the
GPU image has (its package list in the device notes, 2026-11-17), and split the wheels in two."""
import shutil
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

found, first, second, pyver = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
IMAGE = set(map(canonicalize_name, """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow
pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp
""".split()))
CARRY_ANYWAY = {"grpcio", "protobuf"}  # the image has them, perhaps too old for tritonclient's generated code
SEPARATE = {"numpy"}  # numpy 1.26 goes to numpy1/, for a venv of its own
ENV = {"python_version": pyver, "python_full_version": pyver + ".3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix"}

wheels = {}
for path in found.glob("*.whl"):
    name = canonicalize_name(parse_wheel_filename(path.name)[0])
    assert name not in wheels, f"two versions of {name}: {wheels[name].name}, {path.name}"
    wheels[name] = path


def requires(path: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in Parser().parsestr(text).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**ENV, "extra": e}) for e in extras | {""}):
            out.append(req)
    return out


chosen, todo = {}, [("nvidia-pytriton", set()), ("tritonclient", {"grpc", "http"}), ("zstandard", set())]
while todo:
    name, extras = todo.pop()
    if name in chosen and extras <= chosen[name]:
        continue
    chosen[name] = chosen.get(name, set()) | extras
    for req in requires(wheels[name], extras):
        dep = canonicalize_name(req.name)
        if dep in SEPARATE or (dep in IMAGE and dep not in CARRY_ANYWAY):
            continue
        todo.append((dep, set(req.extras)))
for name in sorted(chosen):
    target = first if name in ("nvidia-pytriton", "zstandard") else second
    shutil.copy2(wheels[name], target)
shutil.copy2(wheels["numpy"], second / "numpy1")
left = sorted(set(wheels) - set(chosen) - SEPARATE)
print("left out (the GPU image has them):", ", ".join(left))
PY

if [ -n "$MODELS" ]; then
  BUILT=$(mktemp -d)
  mkdir -p "$BUNDLES"
  for m in ${MODELS//,/ }; do
    # sm_90: the H100 / H200; the split weights stay here (the device re-creates them)
    aotpack build "models/$m.py" -o "$BUILT/$m.tpk" --arch sm_90 --split-weights --force -q
    cp "$BUILT/$m.tpk" "$BUNDLES/$m.tpk"
  done
  rm -rf "$BUILT"
fi

size() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
one=$((tree + $(size "$WHEELS1")))
two=$((tree + $(size "$WHEELS2") + $(size "$BUNDLES")))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
ls -l "$WHEELS1" "$WHEELS2" "$WHEELS2/numpy1" "$BUNDLES" | grep -v '^total'
echo "working tree $(mib "$tree"); call 1 (tree + $WHEELS1): $(mib "$one"); call 2 (tree + $WHEELS2 + $BUNDLES): $(mib "$two"); limit $(mib "$LIMIT")"
if [ "$one" -gt "$LIMIT" ] || [ "$two" -gt "$LIMIT" ]; then
  echo "over the 64 MiB a call may carry: remove untracked files from the tree or bundles from $BUNDLES" >&2
  exit 1
fi
