#!/usr/bin/env bash
# The prepared device check for one NVIDIA GPU: at most 575 s (HARD_S) on one H200 after start-up.
# On the device machine, from the repository root, carrying .whl (fetch_wheels.sh) and .maxtext
# (fetch_maxtext.sh: without it the maxtext section records a skip), with a timeout of 600 s:
#   bash benchmarks/gpu/run.sh
# Writes in $OUT (default ./gpu_bench_out): gpu_bench.jsonl (every measurement, one JSON line
# each, appended as it is taken), run.log (this script's output), info.log, gmm.log, moe.log,
# autotune.log, train.log, maxtext.log, tests.log (each section's output), maxtext/ (MaxText's
# log, metrics file and config: benchmarks/gpu/maxtext.sh), moe_kernels.jsonl (the per-kernel
# table of one MoE layer fwd+bwd; its trace in moe_trace/), tokamax_<device kind>.json (the
# restricted autotune, for src/dropless/ops/gpu/tuned/) and what the train section writes.
# Extra arguments go to `dropless bench gpu`, e.g. --sections gmm --shapes small/G8,small/G64. Each section runs in its own
# process with a time cap; the whole check gets what is left of HARD_S after the wheels install;
# at the hard stop `timeout` sends SIGTERM and the runner kills the running section's group.
# Check it on a CPU first: `dropless bench gpu --dry-run` (tests/bench/test_gpu.py runs that).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu_bench_out}"
# bench/gpu_plan.py's BUDGET_S (550 s) and 25 s for the wheels and nvidia-smi; under the device
# tool's 600 s a command, leaving it the seconds it needs to send $OUT back
HARD_S=575
mkdir -p "$OUT"
main() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    # the device machine has no network, and tokamax is not in its image
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target /tmp/site .whl/*.whl; then
      export PYTHONPATH="/tmp/site"
    else
      echo "run.sh: installing .whl/ failed; running without those wheels (no tokamax)"
    fi
  fi
  export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  # allocate on demand: the torch peer and the section processes share the GPU (`bench gpu`
  # sets this itself too, so running it without this script is safe)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  local left=$((HARD_S - SECONDS))
  # the runner's own budget ends 10 s before the hard stop, so its last records are written
  timeout -k 5 "$left" python3 -m dropless.cli bench gpu --out-dir "$OUT" \
    --budget-s $((left - 10)) "$@"
}
main "$@" 2>&1 | tee "$OUT/run.log"
