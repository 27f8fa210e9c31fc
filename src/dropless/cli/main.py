"""`dropless` command line: parses arguments and calls the library, nothing more.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
the table below is the only place that lists them.

Errors end here: the library raises precise exceptions (ValueError naming the field and value
for a config mistake) and `main` prints them as one line, `dropless: error: <message>`, with exit
status 2 for usage and config errors and 1 for failures at run time. `--traceback` (anywhere on
the command line) or DROPLESS_TRACEBACK=1 shows the full trace instead. Every message printed
here is bounded (`bounded`): a line past MAX_LINE characters keeps its start (the file, key or
argument) and its end (what to do) and says how much of the middle (a long value) was cut.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

COMMANDS = {
    "bench": ("dropless.cli.bench", "benchmarks: grouped matmul, MoE layer, ... (JSON lines)"),
    "train": ("dropless.cli.train", "train a model (no arguments: the tiny preset on the "
                                    "Python stdlib's source, into runs/)"),
    "config": ("dropless.cli.config", "show the effective config, list the accepted keys, or "
                                      "print their reference"),
    "report": ("dropless.cli.report", "draw loss, throughput and expert load of a run to PNG"),
    "plan": ("dropless.cli.plan", "plan a cluster run: memory, FLOPs, bytes, step time, layouts"),
    "convert": ("dropless.cli.convert", "Hugging Face checkpoint -> dropless directory, and back"),
    "eval": ("dropless.cli.eval", "loss and perplexity of a model on a text or JSONL file"),
    "generate": ("dropless.cli.generate", "continue a prompt (greedy or temperature sampling)"),
    "data": ("dropless.cli.data", "prepare corpora (JSONL, Parquet, Arrow, text) as token shards"),
}
# commands that write nothing before their output: SIGINT / SIGTERM end them at once, exit 130 /
# 75, never by unwinding under XLA's running threads (`runtime.interrupt`)
EXIT_ON_SIGNAL = ("eval", "generate")
INTERRUPTED = "dropless: interrupted"   # the line a Ctrl-C ends the other commands with
# commands that never start a JAX backend (the environment's JAX settings are not theirs)
NO_BACKEND = ("config", "report")
# commands that run steps in a loop: with DROPLESS_HOST_MALLOC=reuse, started from the shell, they
# start again with glibc's malloc set to reuse freed memory (runtime.host_memory)
REUSE_HOST_MEMORY = ("train", "bench", "eval")
EXIT_FAILURE = 1         # the run failed (checkpoint write, I/O, device out of memory, ...)
EXIT_USAGE = 2           # bad arguments or config (argparse uses 2 too)
EXIT_INTERRUPTED = 130   # Ctrl-C outside the training loop (128 + SIGINT)
MAX_LINE = 400          # characters of one error line; a longer one loses its middle
TRACEBACK_HINT = "run again with --traceback (or DROPLESS_TRACEBACK=1) for the full trace"


class Parser(argparse.ArgumentParser):
    """argparse with the project's error edge: a usage error is one line naming the argument and
    where to read more, exit 2 (argparse's own prints the usage block first).

    `argv`, when set (by `main`), lets the error name an option given after a KEY=VALUE override:
    argparse then leaves the later overrides over and would blame them."""
    argv: list[str] | None = None

    def error(self, message: str):
        if message.startswith("unrecognized arguments:") and self.argv is not None:
            found = misplaced_option(self.argv)
            if found is not None:
                late, first = found
                message = (f"option {late} comes after the override {first}: put the options "
                           "(and their values) before the KEY=VALUE overrides")
        self.exit(EXIT_USAGE, f"dropless: error: {bounded(message)} (see '{self.prog} --help')\n")


def bounded(line: str, limit: int = MAX_LINE) -> str:
    """`line` if at most `limit` characters, else its first two thirds and last third of
    `limit` around a note of how many characters were cut (a huge value inside a message)."""
    if len(line) <= limit:
        return line
    head, tail = limit * 2 // 3, limit // 3
    return f"{line[:head]} ...[{len(line) - head - tail} characters cut]... {line[-tail:]}"


def misplaced_option(argv: list[str]) -> tuple[str, str] | None:
    """(the first option `--name` that follows a KEY=VALUE override in `argv` and is itself
    followed by another override, that first override), or None."""
    first, late = None, None
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("-") and not _is_number(tok):
            if first is not None and late is None:
                late = tok.split("=", 1)[0]
        elif "=" in tok:
            if late is not None:
                return late, first
            first = first or tok
    return None


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


def build_parser(commands: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with `commands`, of those alone (the others are still
    listed, without their arguments): `main` imports only the command it runs, so that `config`,
    `report` and `data` start without importing JAX."""
    parser = Parser(prog="dropless", description="Dropless MoE training in JAX.")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full Python trace of an error (also DROPLESS_TRACEBACK=1;"
                             " accepted anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if commands is None or name in commands:
            importlib.import_module(module).add_arguments(p)
    return parser


def describe(exc: BaseException) -> tuple[int, str]:
    """(exit status, message) for an exception that reached the command line."""
    text = str(exc).strip() or type(exc).__name__
    lines = text.splitlines()
    first = lines[0] if len(lines) == 1 else lines[0] + " ..."
    if isinstance(exc, ValueError):
        return EXIT_USAGE, first
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) \
            and exc.filename is not None:   # one line: a trace says nothing more
        return EXIT_FAILURE, (f"{exc.strerror}: {exc.filename} (nothing was left half-written; "
                              "free space there, or write elsewhere)")
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename is not None else ""
        return EXIT_FAILURE, f"{exc.strerror}{where} (check the path, its permissions and free " \
                             f"space)\n{TRACEBACK_HINT}"
    from dropless.checkpoint import CheckpointError
    from dropless.train.nonfinite import NonFiniteError
    from dropless.train.rundir import RunDirInUse
    if isinstance(exc, (CheckpointError, RunDirInUse, NonFiniteError)):
        return EXIT_FAILURE, first
    if isinstance(exc, RuntimeError) and "Unable to initialize backend" in text:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        return EXIT_USAGE, (f"JAX_PLATFORMS={platforms!r}: {first} (set JAX_PLATFORMS to an "
                            "available platform, e.g. cpu, or unset it)")
    if "RESOURCE_EXHAUSTED" in text or isinstance(exc, MemoryError):
        return EXIT_FAILURE, f"out of memory: {first}\nlower per_device_batch_size or " \
                             "seq_len, or set remat=full; " + TRACEBACK_HINT
    return EXIT_FAILURE, f"{type(exc).__name__}: {first}\n{TRACEBACK_HINT}"


def exit_on_signal(command: str):
    """The signal handling of `command`: `runtime.interrupt.exit_on_signals` for those of
    EXIT_ON_SIGNAL; the others stop with KeyboardInterrupt, exit 130 (train installs its own
    handlers: it stops after a step and saves), and one that lands in a finalizer ends the
    process with the same line rather than being printed and lost
    (`runtime.interrupt.interrupt_quietly`)."""
    from dropless.runtime.interrupt import exit_on_signals, interrupt_quietly
    if command not in EXIT_ON_SIGNAL:
        return interrupt_quietly(INTERRUPTED)   # an interrupt in a finalizer still stops it
    return exit_on_signals(f"dropless {command}")


def check_environment(command: str) -> None:
    """Refuse (ValueError naming the variable) a JAX_PLATFORMS this installation cannot start,
    an XLA_FLAGS holding a flag XLA does not know, and a cache folder that cannot be written,
    before JAX reads any of them (XLA would abort the process on the flag; JAX fails only at the
    first computation on the platform, and skips an unwritable compilation cache with a
    warning; the CPU peak cache `train` fills would fail after compiling)."""
    from dropless import machine
    from dropless.runtime import environment, xla_flags
    environment.check_platforms(os.environ.get("JAX_PLATFORMS"))
    xla_flags.check_environment_flags(os.environ.get("XLA_FLAGS"))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        environment.check_writable_folder(os.environ["JAX_COMPILATION_CACHE_DIR"],
                                          "JAX_COMPILATION_CACHE_DIR")
    on_cpu = os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or \
        environment.installed_platforms() == ["cpu"]   # the CPU peak cache is read on CPU only
    if command == "train" and on_cpu and not os.environ.get(machine.CPU_PEAK_ENV):
        environment.check_writable_folder(machine.user_cache_dir(), "the dropless cache folder "
                                          "(XDG_CACHE_HOME, else ~/.cache; or set "
                                          f"{machine.CPU_PEAK_ENV})")


def restart_for_host_memory(*, from_shell: bool) -> None:
    """Start this process again with glibc's malloc set to reuse freed memory
    (runtime.host_memory) when it is due and the process came from the shell (`main()` without
    arguments); a call from Python only checks DROPLESS_HOST_MALLOC. Raises ValueError for a bad
    DROPLESS_HOST_MALLOC."""
    from dropless.runtime import host_memory
    env = host_memory.restart_env()
    if env is not None and from_shell:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def main(argv: list[str] | None = None) -> int:
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    trace = os.environ.get("DROPLESS_TRACEBACK", "") not in ("", "0")
    if "--traceback" in argv:
        argv.remove("--traceback")
        trace = True
    parser = build_parser(tuple(argv[:1]))   # the command is the first word (-h: none)
    parser.argv = argv
    args = parser.parse_args(argv)
    try:
        with exit_on_signal(args.command):
            if args.command not in NO_BACKEND:
                check_environment(args.command)
            if args.command in REUSE_HOST_MEMORY:
                restart_for_host_memory(from_shell=from_shell)
            status = int(importlib.import_module(args._module).run(args) or 0)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # the reader went away (`dropless report | head`): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        if trace:
            raise
        print(INTERRUPTED, file=sys.stderr)
        if from_shell:   # the command is unwound; skip the teardown where JAX's and orbax's
            sys.stdout.flush()           # threads would still print (or wait for a join)
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the edge: every error becomes one message
        if trace:
            raise
        status, message = describe(e)
        print("dropless: error: " + "\n".join(bounded(x) for x in message.split("\n")),
              file=sys.stderr)
        # a CheckpointError comes only from a loaded `dropless.checkpoint`; importing it to ask
        # would load JAX into the commands that never need it (`config`, `report`)
        if "dropless.checkpoint" in sys.modules:
            from dropless.checkpoint import CheckpointError
            if isinstance(e, CheckpointError):
                # After some failed saves (a read-only file system) orbax leaves background
                # threads waiting for signals that never come, and the interpreter would wait
                # for them at exit forever; the run's state is settled, so leave without
                # joining them.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        return status


if __name__ == "__main__":
    sys.exit(main())
