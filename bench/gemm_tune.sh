#!/usr/bin/env bash
# On the GPU machine: tune bundles built with --gemm-candidates on the CPU box, compare tuned vs
# untuned latency, verify the tuned bundles, and run the GEMM GPU tests.
#   bash bench/gemm_tune.sh [tests|tune|bench|verify]...
# Bundles: $AOTPACK_GPU_BUNDLES/{mlp,gpt}-gemm.tpk, made on the build box with
#   aotpack build models/mlp.py -o out/mlp-gemm.tpk --gemm-candidates
#   aotpack build models/gpt.py -o out/gpt-gemm.tpk --gemm-candidates
set -uo pipefail
bash bench/device_setup.sh
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
BUNDLES=${AOTPACK_GPU_BUNDLES:-out}
mkdir -p "$OUT/gemm"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/gemm/env.txt"
for what in "$@"; do
  case $what in
    tests) AOTPACK_GPU_BUNDLES=$BUNDLES python3 -m pytest -m gpu -q tests/gpu/test_gemm_gpu.py 2>&1 | tee "$OUT/gemm/tests.log" | tail -30 ;;
    tune)
      for m in mlp gpt; do
        [ -f "$BUNDLES/$m-gemm.tpk" ] || { echo "no $BUNDLES/$m-gemm.tpk"; continue; }
        # beside the untuned bundle: a bundle with split weights reads them from its own folder
        python3 -m aot.cli tune "$BUNDLES/$m-gemm.tpk" -o "$BUNDLES/$m-tuned.tpk" --repeats 50 -v 2>&1 | tee "$OUT/gemm/tune-$m.log" | tail -5
        python3 -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('tuning.json'))" "$BUNDLES/$m-tuned.tpk" > "$OUT/gemm/tuning-$m.json"
      done ;;
    bench)
      for m in mlp gpt; do
        sizes=$([ $m = mlp ] && echo "batch=1 batch=8 batch=64" || echo "batch=1,seq=1 batch=1,seq=128 batch=8,seq=128")
        for s in $sizes; do
          for b in "$BUNDLES/$m-gemm.tpk" "$BUNDLES/$m-tuned.tpk"; do
            [ -f "$b" ] || continue
            echo "== $b $s"
            python3 -m aot.cli load "$b" --device cuda --sizes "$s" --iters 500 --json 2>&1 | tail -1
          done
        done
      done 2>&1 | tee "$OUT/gemm/bench.log" ;;
    verify) for b in "$BUNDLES"/*-tuned.tpk; do echo "== $b"; python3 -m aot.cli verify "$b" 2>&1 | tail -4; done 2>&1 | tee "$OUT/gemm/verify.log" ;;
  esac
done
