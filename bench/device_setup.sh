#!/usr/bin/env bash
# On a GPU machine without network: install aotpack (and wheels carried in .whl/) offline, then
# re-create the split weights of prebuilt bundles in .bundles/ from their seeded model files.
set -euo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
for m in mlp gpt cnn; do
  if [ -f .bundles/$m.tpk ] && ! ls .bundles/$m.weights.*.safetensors >/dev/null 2>&1; then
    python3 bench/regen_weights.py models/$m.py .bundles/$m.tpk
  fi
done
