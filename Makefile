# `make run`: set everything up and run the main job. `make test`: set everything up and run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup run test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/dropless train

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
