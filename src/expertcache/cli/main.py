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
    "expertcache.cli.serve",
]


class UsageError(Exception):
    """Bad user input: printed as one clear line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as exc:
        print(f"expertcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"expertcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
