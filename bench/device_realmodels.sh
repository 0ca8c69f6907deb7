#!/usr/bin/env bash
# On the GPU machine: install offline, then the real-model GPU tests, the eager/aotpack table in
# float32 and float16, and `aotpack verify` of bundles built on the CPU box (out/rm-cpu, carried).
#   bash bench/device_realmodels.sh [tests|table32|table16|verify]...
set -uo pipefail
bash bench/device_setup.sh
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
python3 -c "import torch, triton, transformers, timm, torchvision, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"
for what in "$@"; do
  case $what in
    tests) python3 -m pytest -m gpu -q tests/gpu/test_realmodels_gpu.py 2>&1 | tee $OUT/gpu-tests.log | tail -30 ;;
    table32) python3 bench/realmodels.py --device cuda --dtype float32 --out /tmp/rm32 --json $OUT/realmodels-cuda-float32.json 2>&1 | grep '^{' ;;
    table16) python3 bench/realmodels.py --device cuda --dtype float16 --out /tmp/rm16 --json $OUT/realmodels-cuda-float16.json 2>&1 | grep '^{' ;;
    verify) for b in out/rm-cpu/*.tpk /tmp/rm16/*.tpk; do [ -f "$b" ] || continue; echo "== $b"; python3 -m aot.cli verify "$b" 2>&1 | tail -4; done 2>&1 | tee $OUT/verify.log ;;
  esac
done
