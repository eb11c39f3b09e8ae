"""Every command README.md and docs/*.md print in ```bash blocks runs as printed (issue 27).

Each ``expertcache ...`` line there (continuation lines joined, comments dropped, the block's own shell
variables and the first value of its ``for`` loops substituted) parses with the CLI's own parser, so a renamed or
removed flag cannot stay in the docs. The README's fast commands (first three lines and Quick tour) also run, in a
scratch folder, exactly as printed; the slow ones (minutes) are marked slow, and the one that needs the real
evaluation data skips without it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_shared_data

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_lines(path: Path) -> list[str]:
    """The command lines of the ```bash blocks of ``path``: continuations joined, variables of the block
    expanded (assignments ``NAME=value``; a ``for x in a b`` loop's first value)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        env: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            for name, values in re.findall(r"for (\w+) in ([^;]+);", line):
                env[name] = values.split()[0]
            m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(\S.*)", line)
            if m:
                env[m.group(1)] = " ".join(shlex.split(m.group(2), comments=True))
                continue
            line = re.sub(r"\$(\w+)", lambda v: env.get(v.group(1), v.group(0)), line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def expertcache_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every ``expertcache`` command line of the docs that names concrete arguments."""
    cmds = []
    for path in DOCS:
        for line in bash_lines(path):
            words = shlex.split(line, comments=True)
            if words[:1] == ["expertcache"] and "..." not in words and not any("$" in w for w in words):
                cmds.append((f"{path.name}: {line[:70]}", words[1:]))
    return cmds


COMMANDS = expertcache_commands()


def test_the_docs_print_commands():
    assert len(COMMANDS) >= 40, COMMANDS  # the extraction finds them (README + docs: ~50 today)


@pytest.mark.parametrize("argv", [a for _, a in COMMANDS], ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses(argv):
    from expertcache.cli.main import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: a flag or value the CLI does not take
        pytest.fail(f"expertcache {' '.join(argv)}: does not parse (exit {exc.code})")


# -- the README's commands, run as printed ------------------------------------------------------------------------

README_RUN = [words for where, words in COMMANDS if where.startswith("README.md")]
SLOW = {"sweep", "report", "bench"}   # ~1 min, needs the sweep's rows, ~20 s
NEEDS_DATA = {"eval"}                 # reads WikiText-2 from the data folder (README: "Evaluation data")
RUNS = [a for a in README_RUN if a[0] not in {"serve"} and "TRACE" not in a and "PROFILE_TRACE" not in a]


def _param(argv):
    marks = []
    if argv[0] in SLOW:
        marks.append(pytest.mark.slow)
    if argv[0] in NEEDS_DATA:
        marks.append(needs_shared_data("wikitext-2-raw-v1"))
    return pytest.param(argv, marks=marks, id=" ".join(argv)[:60])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder to run the README's commands in: repo-relative paths (``src/...``) resolve, outputs stay here."""
    root = tmp_path_factory.mktemp("readme")
    (root / "src").symlink_to(REPO / "src")
    return root


def test_readme_runs_list():
    names = [a[0] for a in RUNS]
    assert names[:1] == ["generate"] and {"simulate", "eval", "sweep", "report", "analyze", "bench"} <= set(names)
    # the sweep before the report that reads its rows
    assert names.index("sweep") < names.index("report")


@pytest.mark.parametrize("argv", [_param(a) for a in RUNS])
def test_readme_command_runs_as_printed(argv, scratch, monkeypatch, capsys):
    from expertcache.cli.main import main

    monkeypatch.chdir(scratch)
    if argv[0] == "report" and not (scratch / argv[1]).exists():  # run alone: make the sweep's rows first
        sweep = next(a for a in RUNS if a[0] == "sweep")
        assert main(sweep + ["--no-progress"]) == 0
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
