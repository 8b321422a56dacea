#!/usr/bin/env bash
# The one-shot GPU check. On the GPU machine (torch, triton, grpcio, protobuf, transformers and prometheus-client
# preinstalled; nothing downloadable), from the repository root:
#   bash bench/gpu_check.sh        results in $OUT (default bench/out): gpu_check.json, kernels.json, e2e.xml
# The rest of what the services import travels as wheels in .gpu-wheels/ (`make gpu-wheels` fills it here).
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
  python -m pip install -q --no-index --no-deps --find-links .gpu-wheels .gpu-wheels/*.whl
fi
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'FAIL: torch sees no GPU')"
exec python bench/gpu_check.py --out "$OUT" "$@"
