# `make run`: set everything up and run the main job. `make test`: set everything up and run the tests.
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

.PHONY: setup run test bench clean FORCE

$(VENV)/.installed: pyproject.toml $(STALE)
	@[ "$(word 2,$(PY_INFO))" = 1 ] || { echo "make: dropless needs Python >= $(MIN_PYTHON), but $(PYTHON) is $(or $(PY_VERSION),not runnable); run e.g. 'make PYTHON=python3.12 $(or $(MAKECMDGOALS),run)'"; exit 2; }
	@if [ -e $(VENV) ] && [ "$(VENV_VERSION)" != "$(PY_VERSION)" ]; then echo "make: $(VENV) was made by Python $(or $(VENV_VERSION),that no longer runs), not $(PYTHON) ($(PY_VERSION)): recreating it"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,report]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/dropless train

# one pytest worker a core (2 on CI); a file's tests stay on one worker, so module fixtures
# (compiled steps, end-to-end runs shared by several tests) are built once
TEST_WORKERS ?= auto
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
