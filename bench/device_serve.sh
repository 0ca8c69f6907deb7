#!/usr/bin/env bash
# Serving on the GPU machine: tritonserver (from the nvidia-pytriton wheel) runs a GPU bundle and, beside
# it, the same model in eager PyTorch behind the same Python-backend batching; bench/serve_load.py puts
# closed-loop gRPC load on both. The wheels don't fit one call's 64 MiB, so this takes two calls on one
# warm machine (it stays warm 30 s after a call, and /tmp with it: send the second call at once):
#   bash bench/device_serve.sh install1     carry: .whl-serve1
#   bash bench/device_serve.sh measure      carry: .whl-serve2 .bundles
# bench/stage_serve_wheels.sh fills those folders here first.
# install1: nvidia-pytriton and zstandard into $SITE, aotpack (bench/device_setup.sh), the environment
#   (bench/serve_env.py report: versions, libpython) and a probe of the Python backend under the image's
#   own numpy (bench/serve_env.py probe).
# measure: the other wheels (those the image lacks or has older), the probe again and, where the image's
#   numpy breaks the stub (numpy 2), a venv over the image's Python with numpy 1.26 first, probed in its
#   turn; then tests/gpu/test_serve_gpu.py and bench/serve_load.py for each of $MODELS while time is left.
# Every log and result goes into $OUT/serve.tgz, re-packed after each step, so a step cut off by the
# command's limit still returns what came before it.
# Knobs: DEADLINE (seconds after the start by which every step has ended; 560), DEVICE (cuda), MODELS
# (mlp,gpt), LOAD_SECONDS (10), CONCURRENCY (1,8,32,64), SITE (/tmp/site), VENV (/tmp/serve-venv),
# WHEELS1, WHEELS2, BUNDLES (the carried folders), SKIP_SETUP=1 (aotpack already installed: a CPU box).
set -uo pipefail
PHASE=${1:?usage: bash bench/device_serve.sh install1|measure}
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
RES=${RES:-/tmp/serve-res}/$PHASE  # install1 and measure share /tmp: keep both phases' logs
SITE=${SITE:-/tmp/site}
VENV=${VENV:-/tmp/serve-venv}
WHEELS1=${WHEELS1:-.whl-serve1} WHEELS2=${WHEELS2:-.whl-serve2} BUNDLES=${BUNDLES:-.bundles}
DEVICE=${DEVICE:-cuda} MODELS=${MODELS:-mlp,gpt} LOAD_SECONDS=${LOAD_SECONDS:-10}
CONCURRENCY=${CONCURRENCY:-1,8,32,64} DEADLINE=${DEADLINE:-560}
T0=$(date +%s)
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

pack() { tar czf "$OUT/serve.tgz" -C "$RES" . ; }

# step NAME LIMIT CMD...: CMD under the smaller of LIMIT and the time left to DEADLINE, its output in
# $RES/NAME.log (its tail echoed); returns CMD's status (124: cut off).
step() {
  local name=$1 limit=$2 left start rc
  shift 2
  left=$((DEADLINE - $(date +%s) + T0))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name skipped: past the deadline" | tee -a "$RES/steps.log"
    return 124
  fi
  start=$(date +%s)
  echo "== $name (limit ${limit}s, at +$((start - T0))s): $*" | tee -a "$RES/steps.log"
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" > "$RES/$name.log" 2>&1  # bash: CMD may be a function
  rc=$?
  echo "== $name rc=$rc in $(($(date +%s) - start))s" | tee -a "$RES/steps.log"
  tail -n 25 "$RES/$name.log"
  pack
  return $rc
}

install_wheels() {  # the wheels of $1 that the image lacks or has older (asked without PYTHONPATH)
  local chosen
  chosen=$(env -u PYTHONPATH python3 bench/serve_env.py wheels "$1") || return 1
  [ -z "$chosen" ] && { echo "nothing to install from $1"; return 0; }
  # shellcheck disable=SC2086  # one path a line, no spaces
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $chosen
}

setup() {
  [ -n "${SKIP_SETUP:-}" ] && { echo "SKIP_SETUP: aotpack as installed"; return 0; }
  bash bench/device_setup.sh
}

export -f install_wheels setup
export SITE SKIP_SETUP=${SKIP_SETUP:-}

case $PHASE in
  install1)
    ls "$WHEELS1"/*.whl > /dev/null || { echo "no wheels in $WHEELS1: carry it (bench/stage_serve_wheels.sh)"; exit 2; }
    step install1 240 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS1"/*.whl || exit 1
    step setup 180 setup || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$RES/gpu.txt" 2>&1
    step report 120 python3 bench/serve_env.py report
    step probe-image-numpy 180 python3 bench/serve_env.py probe --json "$RES/probe-image-numpy.json"
    echo "install1 done in $(($(date +%s) - T0))s; now send measure (carry: $WHEELS2 $BUNDLES) at once"
    ;;
  measure)
    if [ ! -d "$SITE/pytriton" ]; then
      echo "no $SITE/pytriton: install1 did not run on this machine (or it went cold since); send install1, then measure at once"
      exit 2
    fi
    step install2 240 install_wheels "$WHEELS2" || exit 1
    step setup 240 setup || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$RES/gpu.txt" 2>&1
    step report 120 python3 bench/serve_env.py report
    PY=(python3)
    step probe-image-numpy 180 python3 bench/serve_env.py probe --json "$RES/probe-image-numpy.json"
    rc=$?
    if [ $rc -eq 3 ]; then
      # The stub runs isolated (PYTHONPATH does not reach it) and reads the site-packages of the first
      # python3 on PATH: numpy 1.26 must sit in a venv of its own, in front of $SITE and the image's.
      step overlay 180 python3 bench/serve_env.py overlay "$VENV" "$SITE" --wheels "$WHEELS2/numpy1" || exit 1
      PY=(env -u PYTHONPATH "$VENV/bin/python3")
      step probe-numpy1 180 "${PY[@]}" bench/serve_env.py probe --json "$RES/probe-numpy1.json"
      rc=$?
      step report-venv 120 "${PY[@]}" bench/serve_env.py report
    fi
    echo "serving from: ${PY[*]} (probe status $rc)" | tee -a "$RES/steps.log"
    if [ $rc -ne 0 ]; then
      echo "Triton's Python backend does not work here: see probe-*.log and report.log in $OUT/serve.tgz"
      pack
      exit 1
    fi
    step test 240 env AOTPACK_GPU_BUNDLES="$BUNDLES" "${PY[@]}" -m pytest -m gpu -q -rs -p no:cacheprovider \
      tests/gpu/test_serve_gpu.py
    for m in ${MODELS//,/ }; do
      step "load-$m" 300 "${PY[@]}" bench/serve_load.py "models/$m.py" "$BUNDLES/$m.tpk" --device "$DEVICE" \
        --seconds "$LOAD_SECONDS" --concurrency "$CONCURRENCY" --json "$RES/serve-$m.json" --md "$RES/serve-$m.md"
    done
    cat "$RES"/serve-*.md 2> /dev/null
    echo "measure done in $(($(date +%s) - T0))s"
    ;;
  *)
    echo "unknown phase $PHASE: install1 or measure"
    exit 2
    ;;
esac
pack
