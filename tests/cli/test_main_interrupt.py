"""Ctrl-C in a command that stops by unwinding (not eval / generate / train): an interrupt that
lands in a finalizer (where Python prints "Exception ignored in ... KeyboardInterrupt" and goes
on) still stops the command at once, with the one line `dropless: interrupted` and exit 130,
nothing else on stderr. The finalizer raises the KeyboardInterrupt itself (no signal timing)."""
import subprocess
import sys
import textwrap

from tests._support.paths import SRC

SCRIPT = textwrap.dedent("""
    import sys
    from dropless.cli import config as config_cli
    from dropless import cli

    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt          # as Ctrl-C arriving inside a finalizer

    def run(args):
        Finalized()
        for _ in range(3 * 10 ** 7):        # the interrupt must stop this, not its end
            pass
        print("the command ran to its end")
        return 0
    config_cli.run = run
    sys.argv = ["dropless", "config", "show"]
    sys.exit(cli.main())
""")


def test_an_interrupt_inside_a_finalizer_stops_the_command_with_one_line():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stderr == "dropless: interrupted\n", r.stderr
    assert "ran to its end" not in r.stdout


def test_other_unraisable_exceptions_still_go_to_the_previous_hook():
    from dropless.runtime.interrupt import interrupt_quietly
    seen = []
    before = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with interrupt_quietly("dropless: interrupted"):
            class Finalized:
                def __del__(self):
                    raise RuntimeError("a finalizer's own error")
            Finalized()
        assert [type(u.exc_value) for u in seen] == [RuntimeError]
        assert sys.unraisablehook == seen.append      # given back after the block
    finally:
        sys.unraisablehook = before
