"""What starting `dropless` imports: the package's names load on first use and the command line
parses only the command it runs, so `data prepare`'s tokenizing processes (which re-run the
`dropless` console script under spawn) and the commands that need no device never import JAX.
Each check runs in a fresh interpreter: this one has imported JAX long ago."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import dropless
from dropless.cli import build_parser
from dropless.cli.main import COMMANDS
from tests._support.paths import ROOT


def _run(code: str, *args: str, cwd=None) -> str:
    """stdout of `code` run by this Python in a fresh process (asserting it succeeded)."""
    r = subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("module", ["dropless", "dropless.cli", "dropless.config",
                                    "dropless.models.arithmetic", "dropless.data.prepare",
                                    "dropless.data.prepare_workers"])
def test_importing_these_imports_no_jax(module):
    out = _run(f"import sys, {module}; print('jax' in sys.modules)")
    assert out.split() == ["False"]


@pytest.mark.parametrize("argv", [["--help"], ["data", "--help"], ["data", "prepare", "--help"],
                                  ["report", "--help"], ["config", "keys"]])
def test_these_commands_run_without_importing_jax(argv):
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from dropless.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                status = main({argv!r})
            except SystemExit as e:
                status = e.code
        print(status, 'jax' in sys.modules)""")
    assert _run(code).split() == ["0", "False"]


# every `config` action that builds a config, each with what it reads: a preset, MaxText's flags,
# a YAML file, the reference (it builds its example's config)
CONFIG_COMMANDS = [["config", "show", "--preset", "deepseek3-1gpu"],
                   ["config", "show", "--preset", "deepseek3-1gpu", "--maxtext"],
                   ["config", "show", "--config", "examples/deepseek3_cpu8.yml"],
                   ["config", "reference"]]


@pytest.fixture(scope="module")
def config_commands_run() -> list[list]:
    """[status, JAX imported, the decoder imported, ml_dtypes imported] after each of CONFIG_COMMANDS, run in turn
    by one fresh interpreter (one each would cost about a second apiece): what the first of
    them imports, the later ones see too."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from dropless.cli import main
        seen = []
        for argv in {CONFIG_COMMANDS!r}:
            with contextlib.redirect_stdout(io.StringIO()), \\
                    contextlib.redirect_stderr(io.StringIO()):
                status = main(argv)
            seen.append([status, 'jax' in sys.modules,
                         'dropless.models.decoder' in sys.modules,
                         'ml_dtypes' in sys.modules])
        print(json.dumps(seen))""")
    return json.loads(_run(code, cwd=ROOT).strip().splitlines()[-1])


def test_the_config_commands_never_import_the_model(config_commands_run):
    """`config show` reads the parameter counts from `models.arithmetic` alone: importing it
    does not bring in `models.decoder` (its package's `forward` loads on first use)."""
    assert [[status, decoder] for status, _, decoder, _ in config_commands_run] == [
        [0, False]] * len(CONFIG_COMMANDS)


def test_the_config_commands_run_without_importing_jax(config_commands_run):
    """MoEConfig checks its gmm_backend against ops/gmm/names.py's list, which loads no
    backend (the packages above it load their names on first use)."""
    assert [[status, jax] for status, jax, _, _ in config_commands_run] == [
        [0, False]] * len(CONFIG_COMMANDS)


def test_the_config_commands_leave_ml_dtypes_unloaded(config_commands_run):
    """A dtype name the configs know is checked by name; ml_dtypes (~0.7 s to import) is loaded
    only to name an unknown one (config/fields.py `_check_dtype`)."""
    assert [[status, ml] for status, _, _, ml in config_commands_run] == [
        [0, False]] * len(CONFIG_COMMANDS)


@pytest.mark.parametrize("argv", [["config", "show", "--preset", "nope"],
                                  ["config", "show", "model.moe.gmm_backend=fast"]])
def test_a_failing_config_command_imports_no_jax(argv):
    """The error's one line is printed without asking whether it was a CheckpointError (which
    would import `dropless.checkpoint`, and JAX)."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from dropless.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main({argv!r})
        print(status, 'jax' in sys.modules, err.getvalue().startswith('dropless: error: '))""")
    assert _run(code).split() == ["2", "False", "True"]


def test_the_models_names_are_their_modules_own():
    """`from dropless.models import forward, init_params, flops_per_token, param_counts` gives
    the functions of `models.decoder` and `models.arithmetic` (imported on first use)."""
    import dropless.models as models
    from dropless.models import arithmetic, decoder
    homes = {"forward": decoder.forward, "init_params": decoder.init_params,
             "flops_per_token": arithmetic.flops_per_token,
             "param_counts": arithmetic.param_counts}
    assert set(models.__all__) == set(homes) and set(homes) <= set(dir(models))
    for name, home in homes.items():
        assert getattr(models, name) is home, name
    from dropless.models import flops_per_token, forward, init_params, param_counts
    assert (forward, init_params, flops_per_token, param_counts) == (
        decoder.forward, decoder.init_params, arithmetic.flops_per_token, arithmetic.param_counts)
    with pytest.raises(AttributeError, match="'dropless.models' has no attribute 'Nope'"):
        models.Nope   # noqa: B018


def test_the_ops_names_are_their_modules_own():
    """`dropless.ops` and `dropless.ops.gmm` load their names on first use (so that
    `ops.gmm.names` loads no backend); each is the function of the module that defines it."""
    import dropless.ops as ops
    import dropless.ops.gmm as gmm
    from dropless.ops.gmm import baselines, registry, tiled
    homes = {n: getattr(registry, n) for n in ("grouped_matmul", "grouped_matmul_backends",
                                               "register_backend", "resolve_backend",
                                               "backend_spec")}
    homes["padding_stats"] = baselines.padding_stats
    assert set(ops.__all__) == set(homes) and set(homes) <= set(dir(ops))
    assert set(gmm.__all__) == set(homes) | {"DEFAULT_TILE_SIZES"}
    for name, home in homes.items():
        assert getattr(ops, name) is home and getattr(gmm, name) is home, name
    assert gmm.DEFAULT_TILE_SIZES is tiled.DEFAULT_TILE_SIZES
    for package in (ops, gmm):
        with pytest.raises(AttributeError, match=f"'{package.__name__}' has no attribute 'Nope'"):
            package.Nope   # noqa: B018


def test_the_package_names_are_the_modules_own():
    import dropless.moe  # noqa: F401
    from dropless import config, ops
    assert set(dropless.__all__) <= set(dir(dropless))
    homes = {"moe": sys.modules["dropless.moe"], "ops": ops, "grouped_matmul": ops.grouped_matmul,
             "grouped_matmul_backends": ops.grouped_matmul_backends}
    homes.update((n, getattr(config, n)) for n in ("MoEConfig", "MeshConfig", "ModelConfig",
                                                   "TrainConfig"))
    assert set(homes) == set(dropless.__all__)
    for name, home in homes.items():
        assert getattr(dropless, name) is home, name
    with pytest.raises(AttributeError, match="'dropless' has no attribute 'Nope'"):
        dropless.Nope   # noqa: B018


def test_a_command_parser_alone_parses_as_the_whole_one():
    """`main` builds the parser of the command it runs; its arguments parse as the parser of
    every command parses them (defaults included)."""
    argv = ["data", "prepare", "in.jsonl", "shards", "--tokenizer", "byte",
            "--workers", "3"]
    whole, alone = build_parser().parse_args(argv), build_parser(("data",)).parse_args(argv)
    assert vars(whole) == vars(alone)
    with pytest.raises(SystemExit):
        build_parser(("data",)).parse_args(["nope"])   # an unknown command is still refused
    assert set(build_parser(()).parse_args(["config"]).__dict__) == {"command", "_module",
                                                                   "traceback"}
    assert set(COMMANDS) == {"bench", "train", "config", "report", "plan", "convert", "eval",
                             "generate", "data"}


def test_a_tokenizing_process_the_console_script_starts_has_no_jax(tmp_path):
    """Under spawn a worker re-runs the main script; the `dropless` console script (pip's
    wrapper, written here as pip writes it) imports `dropless.cli`, and with it nothing heavy:
    the worker reports what it imported and its private memory."""
    script = tmp_path / "dropless_script.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from dropless.cli import main
        def probe():
            with open("/proc/self/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            return {"jax": "jax" in sys.modules, "anon_kb": int(fields["RssAnon"].split()[0])}
        if __name__ == '__main__':
            from dropless.data import prepare_workers as pw
            pool = pw.start_pool(1, pw.Encoder(tokenizer="byte", dtype="uint16", bos=None,
                                               eos=None))
            print(json.dumps(pool.submit(probe).result()))
            pool.shutdown()
        """))
    seen = json.loads(_run("", str(script), cwd=ROOT).strip().splitlines()[-1])
    assert seen["jax"] is False
    assert seen["anon_kb"] < 40_000, seen   # ~17 MB; with JAX imported ~80 MB
