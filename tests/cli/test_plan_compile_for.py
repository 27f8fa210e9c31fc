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
from dropless.train.compile_only import PLUGINS, unavailable


def _plan(argv, capsys) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_plugin(monkeypatch):
    """The jax CUDA plugin made unimportable, whether or not this venv has it (a None entry in
    sys.modules makes `import` raise ImportError, as a missing package does)."""
    for name in PLUGINS:
        monkeypatch.setitem(sys.modules, f"jax_plugins.{name}", None)
    assert unavailable()


@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_without_the_plugin_one_line_says_what_to_install(no_plugin, capsys, kind):
    rc, out, err = _plan(["--preset", "deepseek3-1gpu", "--compile-for", kind], capsys)
    v = jaxlib.__version__
    assert rc == 2 and out == ""
    assert err == (f"dropless: error: --compile-for {kind}: the jax CUDA plugin is not installed "
                   "(jax-cuda13-plugin and jax-cuda13-pjrt of this jax's version, --no-deps): "
                   f"pip install --no-deps jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v} (the GPU "
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


@pytest.mark.parametrize("present,found", [(("xla_cuda13",), "xla_cuda13"),
                                           (("xla_cuda12",), "xla_cuda12"),
                                           (("xla_cuda13", "xla_cuda12"), "xla_cuda13"),
                                           ((), None)])
def test_either_cuda_build_of_the_plugin_serves_cuda13_first(monkeypatch, present, found):
    """`jax[cuda13]` (what dropless[gpu] and the GPU machines install) brings xla_cuda13; jax
    0.12.1 publishes no CUDA 12 build. Either makes compile-only devices; both: CUDA 13, as
    jax's own plugin discovery orders them."""
    import types

    from dropless.train import compile_only
    for name in PLUGINS:
        monkeypatch.setitem(sys.modules, f"jax_plugins.{name}",
                            types.ModuleType(name) if name in present else None)
    assert compile_only.plugin() == found
    assert (compile_only.unavailable() == "") == (found is not None)
