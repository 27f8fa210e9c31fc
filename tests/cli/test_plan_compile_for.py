"""`dropless plan --compile-for` where nothing can be compiled: without the jax CUDA plugin the
option is refused in one line that says what to install (exit 2), as are a target it does not
know and the options it does not go with; nothing is planned or compiled first. (The compile
itself, and the refusal of a config that does not fit, are tests/cli/test_plan_gpu_compile.py,
in the GPU leg.)
"""
from __future__ import annotations

import sys

import jaxlib
import pytest

from dropless.cli import main
from dropless.train.compile_only import unavailable


def _plan(argv, capsys) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_plugin(monkeypatch):
    """The jax CUDA plugin made unimportable, whether or not this venv has it (a None entry in
    sys.modules makes `import` raise ImportError, as a missing package does)."""
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)
    assert unavailable()


@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_without_the_plugin_one_line_says_what_to_install(no_plugin, capsys, kind):
    rc, out, err = _plan(["--preset", "deepseek3-1gpu", "--compile-for", kind], capsys)
    v = jaxlib.__version__
    assert rc == 2 and out == ""
    assert err == (f"dropless: error: --compile-for {kind}: the jax CUDA plugin is not installed "
                   "(jax-cuda12-plugin and jax-cuda12-pjrt of this jax's version, --no-deps): "
                   f"pip install --no-deps jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} (the GPU "
                   "test leg's .venv-jax011 and .venv-jaxnew have it), or leave --compile-for "
                   "out\n")


def test_an_unknown_target_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--compile-for", "a100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") <= 2   # argparse's usage + the error
    assert "argument --compile-for: invalid choice: 'a100' (choose from 'h100', 'h200')" in err


@pytest.mark.parametrize("other", ["--reference", "--calibrate"])
def test_it_does_not_go_with_reference_or_calibrate(no_plugin, capsys, other):
    # checked before the plugin: the combination is wrong whatever is installed
    rc, out, err = _plan(["--compile-for", "h200", other], capsys)
    assert rc == 2 and out == ""
    assert err == ("dropless: error: --compile-for h200 compiles a planned train step; it does "
                   "not go with --reference or --calibrate\n")


def test_without_the_option_the_plan_has_no_compiled_memory(capsys):
    import json
    rc, out, _ = _plan(["--preset", "deepseek3-1gpu", "--hardware", "h100", "--json"], capsys)
    assert rc == 0 and "compiled_memory" not in json.loads(out)
