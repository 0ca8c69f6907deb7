#!/usr/bin/env bash
# On a GPU machine without network: install aotpack (and wheels carried in .whl/) offline, then
# re-create the split weights of prebuilt bundles in .bundles/ from their seeded model files.
set -euo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
for b in .bundles/*.tpk; do
  [ -f "$b" ] || continue
  stem=$(basename "$b" .tpk)
  model=models/${stem%%-*}.py  # gpt-gemm.tpk is a build of models/gpt.py
  if [ -f "$model" ] && ! ls .bundles/$stem.weights.*.safetensors >/dev/null 2>&1; then
    python3 bench/regen_weights.py "$model" "$b"
  fi
done
