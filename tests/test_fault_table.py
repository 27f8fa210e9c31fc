"""The fault table: every row of every `tests/_faults_<area>.py` file, run and checked the same
way (see `_fault.py` for what a row is and what is checked)."""
import importlib
from pathlib import Path

import pytest

from _fault import Artifacts, check_row, command_env

HERE = Path(__file__).resolve().parent
AREAS = [importlib.import_module(p.stem) for p in sorted(HERE.glob("_faults_*.py"))]
ROWS = [row for area in AREAS for row in area.ROWS]
BUILDERS = {name: fn for area in AREAS for name, fn in getattr(area, "BUILDERS", {}).items()}
assert len({r.id for r in ROWS}) == len(ROWS), "two fault rows share an id"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    env = command_env(tmp_path_factory.getbasetemp() / "jaxcache")
    return Artifacts(tmp_path_factory.mktemp("fault_artifacts"), BUILDERS, env)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_fault(row, artifacts, tmp_path):
    check_row(row, tmp_path, artifacts)
