#!/usr/bin/env bash
# Put, here (with network), what a MaxText pre-training run needs on the offline device machine,
# beside dropless, into .maxtext/ (ignored: /.maxtext/ in .gitignore; carry it with .whl):
#   .maxtext/maxtext-src.tar.gz  AI-Hypercomputer/maxtext at e591f30 (the commit compat/maxtext*.py
#                                read), src/maxtext only, less assets/ (tokenizers), examples/ and
#                                notebooks: a synthetic-data run reads no tokenizer
#   .maxtext/whl/                the import-time needs of maxtext.trainers.pre_train.train that
#                                neither the image nor .whl/ (fetch_wheels.sh: tokamax, qwix,
#                                pydantic, xprof, ...) holds, each pinned, installed --no-deps
#   .maxtext/COMMIT              the commit
# Only data: the device-side runner is benchmarks/gpu/maxtext.sh (committed), which `dropless
# bench gpu`'s maxtext section runs (bench/gpu_maxtext.py).
# MaxText imports these at module top level on any run, synthetic data too: pathwaysutils
# (trainers/pre_train/train.py, utils/elastic_utils.py; it imports fastapi, starlette, uvicorn and
# so opentelemetry-api at its own top level), grain (common/checkpointing.py; grain imports
# array_record and portpicker), aqtp (layers/quantizations.py, moe.py, ...), drjax
# (utils/diloco_sharding.py, trainers/diloco), omegaconf (configs/pyconfig.py), ml-collections
# (input_pipeline/grain_data_processing.py, hf_data_processing.py, which
# input_pipeline_interface.py imports when the train loop is set up), and from .whl/ tokamax
# (layers/moe.py, attention_op.py), qwix and pydantic (configs/types.py). tensorflow is only
# try-imported. Google Cloud, goodput, diagnostics and tensorboardX are left out through
# MaxText's own DECOUPLE_GCLOUD=TRUE (common/gcloud_stub.py), which maxtext.sh sets.
# Then the set is checked: a venv of the image's packages (jax 0.11.2 on CPU, made once in
# $CHECK_VENV, default /tmp/dropless-maxtext-check-venv, or an existing one) gets .whl/ and
# .maxtext/whl/ the way maxtext.sh installs them, and a tiny DeepSeek-shaped MaxText model trains
# 2 steps on CPU on synthetic data. A set that does not train fails here.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
COMMIT=e591f30cbbf217ed67ef71263ec0538239f9c3b8
MAXTEXT_GIT="${MAXTEXT_GIT:-/work/.mirror/AI-Hypercomputer+maxtext/repo}"
WHEELS=(pathwaysutils==0.1.13 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
        opentelemetry-api==1.45.3 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0
        aqtp==0.9.0 drjax==0.2.1 omegaconf==2.4.0 ml-collections==1.1.0)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
for w in tokamax qwix pydantic pydantic_core xprof; do
  compgen -G ".whl/$w-*.whl" > /dev/null || { echo "fetch_maxtext: .whl/ lacks $w: run benchmarks/gpu/fetch_wheels.sh first"; exit 1; }
done
rm -rf .maxtext && mkdir -p .maxtext/whl
# the source: the stored snapshot of the repository (its tokenizer assets may be absent: left out)
if git -C "$MAXTEXT_GIT" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
  git -C "$MAXTEXT_GIT" archive --format=tar.gz --prefix=maxtext/ "$COMMIT" src/maxtext \
    ':(exclude)src/maxtext/assets' ':(exclude)src/maxtext/examples' ':(exclude)*.ipynb' \
    > .maxtext/maxtext-src.tar.gz 2> >(grep -v 'invalid object .* for .src/maxtext/assets/' >&2)
else
  curl -fsSL "https://codeload.github.com/AI-Hypercomputer/maxtext/tar.gz/$COMMIT" -o /tmp/maxtext-$COMMIT.tgz
  tmp=$(mktemp -d); tar -xzf /tmp/maxtext-$COMMIT.tgz -C "$tmp"
  tar -czf .maxtext/maxtext-src.tar.gz -C "$tmp" --transform "s,^maxtext-$COMMIT,maxtext," \
    --exclude='*/src/maxtext/assets' --exclude='*/src/maxtext/examples' --exclude='*.ipynb' \
    "maxtext-$COMMIT/src/maxtext"
  rm -rf "$tmp"
fi
listing=$(tar -tzf .maxtext/maxtext-src.tar.gz)
for f in configs/base.yml trainers/pre_train/train.py layers/moe.py; do
  grep -qx "maxtext/src/maxtext/$f" <<< "$listing" || { echo "fetch_maxtext: the source lacks $f"; exit 1; }
done
echo "$COMMIT" > .maxtext/COMMIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .maxtext/whl "${WHEELS[@]}"

du -sh .maxtext .maxtext/whl .maxtext/maxtext-src.tar.gz

# the check: the image's packages (those MaxText's run imports) on CPU, none of the carried ones
CHECK_VENV="${CHECK_VENV:-/tmp/dropless-maxtext-check-venv}"
if [ ! -x "$CHECK_VENV/bin/python" ]; then
  # a Python 3.12, as the image's: .venv-jax011's own interpreter (make setup-gpu-lowering) or python3.12
  CHECK_PY="${CHECK_PY:-}"
  if [ -z "$CHECK_PY" ] && [ -x .venv-jax011/bin/python ]; then
    CHECK_PY="$(.venv-jax011/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python3"
  fi
  CHECK_PY="${CHECK_PY:-python3.12}"
  "$CHECK_PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { echo "fetch_maxtext: the check needs a Python 3.12 (set CHECK_PY)"; exit 1; }
  "$CHECK_PY" -m venv "$CHECK_VENV"
  "$CHECK_VENV/bin/python" -m pip install -q jax==0.11.2 jaxlib==0.11.2 flax==0.12.12 optax==0.2.8 \
    orbax-checkpoint==0.12.8 tensorstore==0.1.86 chex einops etils absl-py protobuf numpy \
    sentencepiece==0.2.2 tiktoken==0.14.0 tokenizers transformers==5.17.0 safetensors pyyaml jinja2 \
    requests rich msgpack psutil tqdm jaxtyping treescope huggingface-hub scipy ml-dtypes humanize \
    aiofiles sympy pillow six cloudpickle click h11 anyio annotated-doc uvloop simplejson
  # the image has no pydantic (typer, there and here, would pull it in): the carried one must serve
  "$CHECK_VENV/bin/python" -m pip uninstall -q -y pydantic pydantic-core annotated-types typing-inspection || true
fi
check_out=$(mktemp -d)
OUT="$check_out" PYTHON="$CHECK_VENV/bin/python" MAXTEXT_SITE="$check_out/site" MAXTEXT_SRC="$check_out/src" \
  MAXTEXT_HARDWARE=cpu bash benchmarks/gpu/maxtext.sh skip_jax_distributed_system=true steps=2 \
  per_device_batch_size=1 max_target_length=128 base_emb_dim=64 base_num_query_heads=4 \
  base_num_kv_heads=4 base_mlp_dim=128 base_moe_mlp_dim=32 base_num_decoder_layers=2 \
  num_experts=8 num_experts_per_tok=2 shared_experts=1 n_routing_groups=4 topk_routing_group=2 \
  q_lora_rank=32 kv_lora_rank=16 qk_nope_head_dim=16 qk_rope_head_dim=8 v_head_dim=16 \
  vocab_size=1024 > "$check_out/check.log" 2>&1 || true
if grep -q "completed step: 1," "$check_out/check.log" && [ "$(wc -l < "$check_out/maxtext_metrics.jsonl")" -eq 2 ]; then
  grep -E "^maxtext.sh: |completed step" "$check_out/check.log" | cut -c1-200
  echo "fetch_maxtext: MaxText $COMMIT trains 2 steps on CPU with the image's packages, .whl/ and .maxtext/whl/"
  rm -rf "$check_out"
else
  tail -40 "$check_out/check.log"
  echo "fetch_maxtext: the CPU check failed (log: $check_out/check.log)"; exit 1
fi
