"""The fault table: every row of every `tests/_support/faults_<area>.py` file, run and
checked the same way (see `tests/_support/fault.py` for what a row is, what is checked and where
a row runs).

Areas (one rows file each; a new failure mode is one more row in its area's file):
- cli: command-line arguments (unknown commands; `plan` and `bench` flags refused before
  anything is computed or compiled);
- config: config values (strict booleans and types, duplicate YAML keys, options after
  overrides, values that are not YAML);
- data: training data files (JSONL lines, UTF-8, .json, directories, .bin / .npy sizes, dtypes
  and id ranges, splits shorter than seq_len);
- ckpt: damaged checkpoints and their fall-back, refused resumes, torn metrics.jsonl, `report`
  on runs without steps, signals during start-up;
- hf: Hugging Face folders (config formats and values, safetensors headers and byte ranges);
- model: model folders and their use (tokenizers, `convert`, `eval`, `generate` arguments,
  atomic writes).

Rows marked `in_process` (refused before any JAX computation) run inside this process in
milliseconds; the rest start `python -m dropless.cli` (~1.5-3 s each before their own work).
Each row gets its own empty case directory; shared inputs (`BUILDERS`) are built once and copied.
"""
import importlib
import os

import jax  # noqa: F401 - imported before any row: its import sets environment variables
import pytest

from tests._support.fault import Artifacts, check_row, command_env

from tests._support.paths import SUPPORT  # noqa: E402

AREAS = [importlib.import_module(f"tests._support.{p.stem}")
         for p in sorted(SUPPORT.glob("faults_*.py"))]
ROWS = [row for area in AREAS for row in area.ROWS]
BUILDERS = {name: fn for area in AREAS for name, fn in getattr(area, "BUILDERS", {}).items()}
assert len({r.id for r in ROWS}) == len(ROWS), "two fault rows share an id"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    env = command_env(tmp_path_factory.getbasetemp() / "jaxcache")
    return Artifacts(tmp_path_factory.mktemp("fault_artifacts"), BUILDERS, env)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_fault(row, artifacts, tmp_path):
    env, cwd = dict(os.environ), os.getcwd()
    check_row(row, tmp_path, artifacts)
    # an in-process row leaves this process as it found it (the next row's setup is its own)
    assert dict(os.environ) == env and os.getcwd() == cwd
