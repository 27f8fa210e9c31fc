#!/usr/bin/env bash
# MaxText pre-training on synthetic data, the device-side runner: from the repository root, on
# the device machine carrying .whl (fetch_wheels.sh) and .maxtext (fetch_maxtext.sh: the MaxText
# source at .maxtext/COMMIT and the wheels its imports need), or here for fetch_maxtext.sh's check:
#   bash benchmarks/gpu/maxtext.sh [key=value ...]
# runs examples/deepseek3_1gpu_maxtext.yml (deepseek3-1gpu in MaxText's flags) over MaxText's
# base.yml, then these overrides (the last of a key wins), e.g. steps=20. Writes in $OUT (default
# ./maxtext_out): maxtext_train.log (the whole log: each step's 'completed step: N, seconds: S,
# TFLOP/s/device: T, Tokens/s/device: K, ...'), maxtext_metrics.jsonl (one JSON line a step:
# perf/step_time_seconds, perf/per_device_tflops_per_sec, perf/per_device_tokens_per_sec,
# learning/loss, step) and maxtext_ds3.yml (the config it ran). MAXTEXT_HARDWARE=cpu (and
# skip_jax_distributed_system=true) runs it without a GPU. `dropless bench gpu`'s maxtext section
# (bench/gpu_maxtext.py) runs it. Environment: MAXTEXT_DIR (default .maxtext), PYTHON (python3),
# MAXTEXT_SITE and MAXTEXT_SRC (where the wheels and the source are unpacked: /tmp/maxtext-site,
# /tmp/maxtext-src). Exit status: MaxText's; 2 when MAXTEXT_DIR lacks what fetch_maxtext.sh puts.
set -uo pipefail
cd "$(dirname "$0")/../.."
MAXTEXT_DIR="${MAXTEXT_DIR:-.maxtext}"
OUT="${OUT:-maxtext_out}"; mkdir -p "$OUT"
SITE="${MAXTEXT_SITE:-/tmp/maxtext-site}"; SRC="${MAXTEXT_SRC:-/tmp/maxtext-src}"
PY="${PYTHON:-python3}"
main() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl "$MAXTEXT_DIR"/whl/*.whl || { echo "maxtext.sh: installing the wheels failed"; return 1; }
  rm -rf "$SRC" && mkdir -p "$SRC" && tar -xzf "$MAXTEXT_DIR/maxtext-src.tar.gz" -C "$SRC" --strip-components=1
  { echo "base_config: base.yml"; grep -v '^#' examples/deepseek3_1gpu_maxtext.yml; } > "$OUT/maxtext_ds3.yml"
  export PYTHONPATH="$SRC/src:$SITE" DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
  # with XLA_FLAGS unset MaxText sets it to dump jit_train_step's HLO into /tmp/xla_dump
  # (configs/types.py, validate_and_set_hlo_dump_defaults); a flag at its default value stops that
  export XLA_FLAGS="${XLA_FLAGS:---xla_cpu_enable_fast_math=false}"
  "$PY" - <<'PYV'
from importlib.metadata import version, PackageNotFoundError
need = {"flax": "0.12.7", "optax": "0.2.6", "orbax-checkpoint": "0.12.4", "jax": "0.10.0",
        "transformers": "5.8.0"}
for name in ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "tensorstore",
             "transformers", "numpy", "pydantic", "tokamax", "qwix", "grain"]:
  try:
    v = version(name)
  except PackageNotFoundError:
    v = "MISSING"
  low = name in need and v != "MISSING" and tuple(map(int, v.split(".")[:3])) < tuple(map(int, need[name].split(".")))
  print(f"maxtext.sh: {name} {v}" + (f"  (MaxText asks >= {need[name]})" if low else ""))
PYV
  echo "maxtext.sh: MaxText $(cat "$MAXTEXT_DIR/COMMIT" 2>/dev/null || echo '?'), overrides: $*"
  local t0=$SECONDS
  "$PY" -m maxtext.trainers.pre_train.train "$OUT/maxtext_ds3.yml" run_name=maxtext_ds3 \
    base_output_directory=/tmp/maxtext-runs hardware="${MAXTEXT_HARDWARE:-gpu}" \
    dataset_type=synthetic enable_checkpointing=false metrics_file="$OUT/maxtext_metrics.jsonl" "$@"
  local rc=$?
  echo "maxtext.sh: MaxText exited $rc after $((SECONDS - t0)) s"
  return $rc
}
for f in maxtext-src.tar.gz COMMIT whl; do
  [ -e "$MAXTEXT_DIR/$f" ] || { echo "maxtext.sh: $MAXTEXT_DIR/$f is missing: run benchmarks/gpu/fetch_maxtext.sh (with network) and carry .maxtext"; exit 2; }
done
rm -f "$OUT/maxtext_metrics.jsonl"
main "$@" 2>&1 | tee "$OUT/maxtext_train.log"
exit "${PIPESTATUS[0]}"
