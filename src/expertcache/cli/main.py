"""Entry point of the ``expertcache`` command.

Each sub-command is a module in this package exposing ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed namespace; returns an exit code). Add a new command by listing its
name and one-line help in ``HELP``; modules that need optional dependencies import them
inside ``func``.

Start-up is kept light: ``--version`` and the top-level help import no command module (so no torch), and
``expertcache CMD ...`` imports only ``CMD``'s module. A missing optional package (``transformers``,
``matplotlib``, ...) is reported as one line naming the extra to install, exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import os
import sys

from expertcache import __version__

# Each command (module ``expertcache.cli.<name>``, in listing order) with its one-line help for the top-level
# listing, so that ``expertcache --help`` needs no command module (tests/test_cli.py checks that these match what
# each module registers).
HELP = {
    "simulate": "open-loop cache simulation of a routing trace",
    "train": "train a small MoE LM from scratch (or write its model card)",
    "analyze": "activation profiling of a routing trace; ERAS biasing profile",
    "eval": "closed-loop evaluation (quality + miss rate) of a policy inside a model",
    "sweep": "sweep policies x strengths x cache sizes x evictions into JSONL rows",
    "report": "Pareto table and figures from JSONL result rows",
    "sensitivity": "perplexity when dropping / randomly replacing experts by rank (001 Fig. 2)",
    "trace": "record a routing trace from a model, or describe one",
    "mole": "Mixture of Lookup Experts: train, export tables, generate, evaluate",
    "generate": "stream tokens with experts offloaded to disk or host RAM",
    "bench": "decode throughput of routing policies at equal memory (vs the physical floor)",
    "melinoe": "004 MELINOE: locality fine-tuning and an expert-activation predictor",
    "serve": "OpenAI-compatible server with continuous batching over the offloaded runtime",
}
COMMANDS = [f"expertcache.cli.{name}" for name in HELP]
#: the commands that import torch and transformers to load a model; every command imports torch (the trace
#: format, the simulator's kernels: simulate peaks at 343 MiB), so all are checked against the memory cgroup first
MODEL_COMMANDS = frozenset(("train", "eval", "sweep", "sensitivity", "trace", "mole", "generate", "bench", "melinoe",
                            "serve"))

# Optional packages -> the extra of pyproject.toml that installs them.
OPTIONAL_EXTRAS = {
    "transformers": "hf", "tokenizers": "hf", "huggingface_hub": "hf",
    "matplotlib": "plot", "numba": "fast", "llvmlite": "fast",
}


def missing_dependency_message(exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra that provides the module ``exc`` could not import, or None when it is not an
    optional dependency of expertcache (then the error is a bug and keeps its traceback)."""
    root = (exc.name or "").split(".")[0]
    if root == "torch":
        return "needs PyTorch, which is not installed: see the set-up section of the README (CPU or CUDA build)"
    extra = OPTIONAL_EXTRAS.get(root)
    if extra is None:
        return None
    if importlib.util.find_spec(root) is not None:  # installed, but too old / broken
        return (f"the installed {root} lacks {exc.name!r} (too old?): pip install -U 'expertcache[{extra}]' "
                f"(see pyproject.toml for the supported versions)")
    return (f"needs the optional package {root!r}, which is not installed: pip install 'expertcache[{extra}]' "
            f"(in a checkout: pip install -e '.[{extra}]')")


class UsageError(Exception):
    """Bad user input: printed as one clear line, exit code 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (``expertcache simulate: error: argument --lam: ...``), exit 2.
    Sub-command parsers inherit the class (``add_subparsers`` uses the parent's type)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _silence_stdout() -> None:
    """Point stdout (closed by its reader, or on a full disk) at /dev/null, so that the interpreter's final flush
    of what is still buffered does not fail a second time ('Exception ignored ... BrokenPipeError')."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured): nothing is flushed at exit
        pass


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line, naming the file for OS errors (``[Errno 21] ...: 'x'`` becomes
    ``x: Is a directory``)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    elif isinstance(exc, UnicodeDecodeError):
        text = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def build_parser(only: str | None = "*") -> argparse.ArgumentParser:
    """The full parser (``only='*'``), or one in which only command ``only`` is fully registered (None: none)
    and the others are listed by name and help alone."""
    parser = _Parser(
        prog="expertcache",
        description="Run and study Mixture-of-Experts models with a per-layer expert cache "
        "and cache-aware routing.",
    )
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in HELP:
        if only == "*" or name == only:
            importlib.import_module(f"expertcache.cli.{name}").register(sub)
        else:
            sub.add_parser(name, help=HELP[name], add_help=False)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named in ``argv`` (its first non-option word), if any."""
    for a in argv:
        if not a.startswith("-"):
            return a
        if a == "--":
            return None
    return None


def _warnings_as_lines(command: str) -> None:
    """Print expertcache's own input warnings (:class:`expertcache.inputs.InputWarning`) as one line each,
    ``expertcache CMD: warning: ...``; other warnings as Python shows them."""
    import warnings

    from expertcache.inputs import InputWarning

    show = warnings.showwarning
    if getattr(show, "expertcache", False):
        show = show.original

    def one_line(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, InputWarning):
            print(f"expertcache {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    one_line.expertcache, one_line.original = True, show
    warnings.showwarning = one_line


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's command line) with the garbage collector paused while it
    starts (:mod:`expertcache.cli.gcpause`: imports, the parser; a command whose parser sets ``gc_paused_start``,
    ``generate``, keeps it paused until its first token); the objects made meanwhile frozen only when the command
    line is the process's own (``argv`` None: the process ends with the command)."""
    from expertcache.cli.gcpause import GCPause

    with GCPause(freeze=argv is None) as pause:
        return _main(list(sys.argv[1:] if argv is None else argv), pause)


def _main(argv: list[str], pause) -> int:
    if sys.stdout is None:  # started with stdout closed (``>&-``): every print would fail with AttributeError
        if sys.stderr is not None:
            print(f"expertcache {_command_of(argv) or ''}: error: stdout is closed (run it with an output, e.g. "
                  "> /dev/null)".replace("  ", " "), file=sys.stderr)
        return 2
    if argv[:1] == ["--version"]:  # fast path: no command module, no torch
        print(f"expertcache {__version__}")
        return 0
    command = _command_of(argv)
    if command in HELP and not {"-h", "--help"} & set(argv):
        from expertcache.container import check_import_floor

        refusal = check_import_floor(command)  # before torch: a cgroup below it kills the import, not a plan
        if refusal is not None:
            print(f"expertcache {command}: error: {refusal}", file=sys.stderr)
            return 2
    try:
        parser = build_parser(command if command in HELP else None)
    except ModuleNotFoundError as exc:
        message = missing_dependency_message(exc)
        if message is None:
            raise
        print(f"expertcache {command or ''}: error: {message}".replace("  ", " "), file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a flag error (one line on stderr, code 2) or --help (code 0): return the code
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if not getattr(args, "gc_paused_start", False):
        pause.resume()
    _warnings_as_lines(args.command)
    try:
        from expertcache.outputs import check_args

        check_args(args, args.command)  # no output may damage an input or a user's file: before any work
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a full disk or closed pipe on stdout fails here, inside the handlers below
        return code
    except ModuleNotFoundError as exc:  # an optional dependency the command needs
        message = missing_dependency_message(exc)
        if message is None:
            raise
        print(f"expertcache {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is None and exc.errno in (errno.EPIPE, errno.ENOSPC):  # the files we write name themselves
            _silence_stdout()
            print(f"expertcache {args.command}: error: stdout: {exc.strerror or exc} (the output was cut short)",
                  file=sys.stderr)
            return 2
        print(f"expertcache {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except UnicodeEncodeError as exc:  # PYTHONIOENCODING=ascii, a C locale: the output, not an input, is at fault
        print(f"expertcache {args.command}: error: stdout: cannot write {exc.object[exc.start:exc.end]!r} in the "
              f"output's encoding {exc.encoding} (set PYTHONIOENCODING=utf-8)", file=sys.stderr)
        return 2
    except (UsageError, ValueError) as exc:  # bad input: files, flags, prompts, output paths
        print(f"expertcache {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"expertcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    # run the package module's main: ``python -m`` loads this file as __main__, a second copy whose UsageError
    # would not be the class the commands raise
    from expertcache.cli.main import main as _main

    sys.exit(_main())
