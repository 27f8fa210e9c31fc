#!/usr/bin/env bash
# The prepared device check for one NVIDIA GPU, sized to finish in under 8 minutes on one H200.
# From the repository root (on the device machine: `bash benchmarks/gpu/run.sh`):
#   writes $OUT/gpu_bench.jsonl, $OUT/gpu_tests.log, $OUT/train.log and $OUT/run.log
#   (OUT defaults to ./gpu_bench_out). Extra arguments go to `dropless bench gpu`, e.g.
#   --sections gmm --shapes G8,dsv3_ep. Wheels in .whl/ (benchmarks/gpu/fetch_wheels.sh) are
#   installed first: the device machine has no network, and tokamax is not in its image.
# Check it on a CPU first: `dropless bench gpu --dry-run` (tests/test_bench.py runs that).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu_bench_out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# allocate on demand: the torch peer and the child processes (tests, training) share the GPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 470 python3 -m dropless.cli bench gpu --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
