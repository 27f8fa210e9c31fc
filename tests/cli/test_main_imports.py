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
                                    "dropless.data.prepare", "dropless.data.prepare_workers"])
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
