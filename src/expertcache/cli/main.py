"""Entry point of the ``expertcache`` command.

Each sub-command is a module in this package exposing ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed namespace; returns an exit code). Add a new command by listing its
module in ``COMMANDS``; modules that need optional dependencies import them inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from expertcache import __version__

COMMANDS = [
    "expertcache.cli.simulate",
    "expertcache.cli.train",
    "expertcache.cli.analyze",
    "expertcache.cli.eval",
    "expertcache.cli.sweep",
    "expertcache.cli.report",
    "expertcache.cli.sensitivity",
    "expertcache.cli.trace",
    "expertcache.cli.mole",
    "expertcache.cli.generate",
    "expertcache.cli.bench",
]


class UsageError(Exception):
    """Bad user input: printed as one clear line, exit code 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (``expertcache simulate: error: argument --lam: ...``), exit 2.
    Sub-command parsers inherit the class (``add_subparsers`` uses the parent's type)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="expertcache",
        description="Run and study Mixture-of-Experts models with a per-layer expert cache "
        "and cache-aware routing.",
    )
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a flag error (one line on stderr, code 2) or --help (code 0): return the code
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, OSError) as exc:  # bad input: files, flags, prompts, output paths
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
