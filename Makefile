# `make run`: set everything up and run the main job. `make test`: set everything up and run the
# tests in three legs: the main suite (`make test-main`, this machine's Python), the native
# library's tests on its AVX2 build (`make test-native-avx2`) and the GPU-facing tests on the JAX
# that GPU machines have (`make test-gpu-lowering`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# the same as requires-python in pyproject.toml
MIN_PYTHON := 3.11

# "major.minor ok" of $(PYTHON), and "major.minor" of the venv's interpreter (empty when the venv
# is missing or its interpreter no longer runs, e.g. a pyenv version that was removed)
VERSION_OF = $(shell $(1) -c 'import sys; v = sys.version_info; print(f"{v[0]}.{v[1]}", int(v[:2] >= tuple(map(int, "$(MIN_PYTHON)".split(".")))))' 2>/dev/null)
PY_INFO := $(call VERSION_OF,$(PYTHON))
PY_VERSION := $(word 1,$(PY_INFO))
VENV_VERSION := $(word 1,$(call VERSION_OF,$(PY)))

# a venv made by another Python (or a broken one) is rebuilt, not reused
ifneq ($(VENV_VERSION),$(PY_VERSION))
STALE := FORCE
endif

.PHONY: setup run test test-main test-native-avx2 test-gpu-lowering setup-gpu-lowering bench clean FORCE

$(VENV)/.installed: pyproject.toml $(STALE)
	@[ "$(word 2,$(PY_INFO))" = 1 ] || { echo "make: dropless needs Python >= $(MIN_PYTHON), but $(PYTHON) is $(or $(PY_VERSION),not runnable); run e.g. 'make PYTHON=python3.12 $(or $(MAKECMDGOALS),run)'"; exit 2; }
	@if [ -e $(VENV) ] && [ "$(VENV_VERSION)" != "$(PY_VERSION)" ]; then echo "make: $(VENV) was made by Python $(or $(VENV_VERSION),that no longer runs), not $(PYTHON) ($(PY_VERSION)): recreating it"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[test,report,mkl]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/dropless train

# one pytest worker a core (2 on CI); a file's tests stay on one worker, so module fixtures
# (compiled steps, end-to-end runs shared by several tests) are built once
TEST_WORKERS ?= auto
export TEST_WORKERS
# every leg runs whatever the others did; .ci/legs prints one line a leg (passed / FAILED, time)
# and names the failed ones
LEGS := test-main test-native-avx2 test-gpu-lowering
test: setup
	@MAKE="$(MAKE)" .ci/legs $(LEGS)

# the device check's dry run (tests/bench/test_gpu.py, minutes) is the GPU leg's, on the JAX
# GPU machines run; the main leg runs it only where that leg cannot (no Python 3.12 found)
MAIN_SKIPS = $(if $(shell .ci/find_python312 2>/dev/null),--ignore=tests/bench/test_gpu.py)
test-main: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(MAIN_SKIPS)

# the native CPU library's tests and the MoE layer's again, on the library built for AVX2
# (-mno-avx512f): a kernel choice that differs by CPU is exercised on every machine. This leg
# keeps XLA:CPU's default optimisation level (the main leg compiles at -O0, tests/conftest.py),
# so it also runs the files of the tests marked xla_default_opt, which the main leg deselects.
XLA_DEFAULT_OPT_TESTS := $(shell grep -rl --include='test_*.py' 'mark.xla_default_opt' tests)
NATIVE_AVX2_TESTS := tests/ops/native tests/moe/test_layer.py $(XLA_DEFAULT_OPT_TESTS)
# two builds racing into one cache is the same code whatever the ISA: the main leg's
NATIVE_AVX2_SKIPS := --deselect tests/ops/native/test_load.py::test_concurrent_builds_into_one_empty_cache_both_load
NATIVE_AVX2_ENV := DROPLESS_NATIVE_ISA=avx2 DROPLESS_TEST_XLA_OPT=default
test-native-avx2: setup
	$(NATIVE_AVX2_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(NATIVE_AVX2_TESTS) $(NATIVE_AVX2_SKIPS)

# The second leg: the CUDA-lowering, Triton-verify, sm_90-compile, interpret-mode and
# `bench gpu --dry-run` tests in Python 3.12 venvs (.ci/find_python312 says which 3.12) with
# jax 0.11.2 (what the H200 machines have) and the newest release, pinned exactly so a CI run is
# reproducible (bump by hand after `pip index versions jax`). .ci/jax_leg reuses a venv until
# pyproject.toml or its pin changes. Without Python 3.12 the leg is skipped with a message;
# GPU_LEG=required (what .ci/run sets) makes that an error. $(wildcard): the files that exist.
# GPU_TESTS run in both venvs. A test file named test_*_gpu_compile.py (GPU_COMPILE_TESTS: whole
# programs and kernels compiled for a compile-only H100/H200, minutes each) and the device check's
# dry run (DEVICE_CHECK_TESTS: it runs on the GPU machines' JAX only) run in the jax 0.11.2 venv
# only, the JAX those machines run; the newest release gets the lowering tests.
JAX_LEG_OLD := 0.11.2
JAX_LEG_NEW := 0.12.1
GPU_TESTS := $(wildcard tests/ops/gpu/test_triton_check*.py tests/ops/gpu/test_pallas_gpu.py \
               tests/ops/gpu/test_pallas_gpu_aligned.py tests/ops/gpu/test_mosaic_gpu.py \
               tests/ops/gpu/test_tokamax_tuned.py tests/ops/gpu/test_cudnn_ragged.py \
               tests/ops/gpu/test_tokamax_backend.py \
               tests/moe/dispatch/test_overlap_schedule.py tests/ops/test_attention.py \
               tests/ops/gpu/test_cudnn_attention_lowering.py tests/ops/gpu/test_cudnn_thd.py)
DEVICE_CHECK_TESTS := $(wildcard tests/bench/test_gpu.py)
GPU_COMPILE_TESTS := $(wildcard tests/*/test_*_gpu_compile.py tests/*/*/test_*_gpu_compile.py)
# The files xdist hands out first (.ci/jax_leg keeps the command line's order: the longest
# first, so the leg's two workers finish together rather than one waiting on the other's last
# long file); the others follow in the lists' order.
GPU_LONGEST := $(wildcard tests/train/test_preflight_gpu_compile.py \
                 tests/train/test_preflight_scanned_gpu_compile.py tests/bench/test_gpu.py \
                 tests/train/test_step_accumulation_gpu_compile.py \
                 tests/ops/gpu/test_mosaic_gpu_compile.py tests/moe/dispatch/test_overlap_schedule.py \
                 tests/cli/test_plan_gpu_compile.py tests/train/test_preflight_mesh_gpu_compile.py)
longest_first = $(filter $(1),$(GPU_LONGEST)) $(filter-out $(GPU_LONGEST),$(1))
setup-gpu-lowering:
	.ci/jax_leg .venv-jax011 $(JAX_LEG_OLD) setup
	.ci/jax_leg .venv-jaxnew $(JAX_LEG_NEW) setup

test-gpu-lowering:
	.ci/jax_leg .venv-jax011 $(JAX_LEG_OLD) test $(call longest_first,$(GPU_TESTS) $(DEVICE_CHECK_TESTS) $(GPU_COMPILE_TESTS))
	.ci/jax_leg .venv-jaxnew $(JAX_LEG_NEW) test $(call longest_first,$(GPU_TESTS))

clean:
	rm -rf $(VENV) .venv-jax011 .venv-jaxnew .pytest_cache .hypothesis
