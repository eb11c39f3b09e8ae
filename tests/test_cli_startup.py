"""Start-up of the ``expertcache`` command: fast --version / --help (no torch), one-line messages for missing
optional packages, help listing in sync with the command modules."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache.cli.main import COMMANDS, HELP

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env,
                          timeout=120)


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_version_and_help_do_not_import_torch(argv):
    code = ("import sys\nfrom expertcache.cli.main import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'transformers', 'numba') if m in sys.modules)\n"
            "print('HEAVY', heavy, 'RC', rc)")
    proc = _python(code, *argv)
    assert "HEAVY [] RC" in proc.stdout, proc.stdout + proc.stderr
    if argv == ["--version"]:
        assert proc.stdout.startswith("expertcache 0.") and "RC 0" in proc.stdout
    else:
        assert all(name in proc.stdout for name in HELP)  # every command is listed with its help


def test_module_entry_point_version_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "expertcache.cli.main", "--version"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0 and proc.stdout.startswith("expertcache ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "expertcache" in imported and "torch" not in imported


def test_package_import_is_light():
    proc = _python("import sys, expertcache; print(expertcache.__version__, 'torch' in sys.modules)")
    assert proc.stdout.split()[1] == "False"


def test_help_table_matches_the_registered_commands():
    """HELP (used for the fast top-level listing) says what each command module registers."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert registered == HELP


_BLOCK = ("import sys\nfor m in sys.argv[1].split(','):\n    sys.modules[m] = None\n"
          "from expertcache.cli.main import main\nsys.exit(main(sys.argv[2:]))")


@pytest.mark.parametrize("blocked, argv, extra", [
    ("transformers,tokenizers,huggingface_hub", ["generate", "--max-new-tokens", "1", "hello"], "hf"),
    ("transformers,tokenizers,huggingface_hub", ["eval", "--model", "granular", "--task", "wikitext", "--limit", "1",
                                                 "--data-dir", "{data}"], "hf"),
    ("transformers,tokenizers,huggingface_hub", ["trace", "record", "--model", "granular", "--task", "wikitext",
                                                 "--tokens", "64", "--out", "{tmp}/t.trace.safetensors",
                                                 "--data-dir", "{data}"], "hf"),
])
def test_missing_optional_package_names_the_extra(tmp_path, toy_data_dir, blocked, argv, extra):
    # a data folder is given (toy rows): the data is found, the missing package is what stops the command
    proc = _python(_BLOCK, blocked, *[a.replace("{tmp}", str(tmp_path)).replace("{data}", toy_data_dir) for a in argv])
    # the resolved configuration may be printed first (one informational line); the error is one line
    lines = [line for line in proc.stderr.strip().splitlines() if ": error: " in line]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"expertcache[{extra}]" in lines[0] and blocked.split(",")[0] in lines[0]


def test_missing_matplotlib_names_the_plot_extra(tmp_path):
    rows = Path(__file__).resolve().parents[1] / "docs" / "results" / "open-loop-granular.jsonl"
    proc = _python(_BLOCK, "matplotlib", "report", str(rows), "--out-dir", str(tmp_path / "figs"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("pip install -e '.[plot]')")
    assert "Traceback" not in proc.stderr and "expertcache[plot]" in proc.stderr


def test_a_missing_non_optional_module_keeps_its_traceback():
    from expertcache.cli.main import missing_dependency_message

    assert missing_dependency_message(ModuleNotFoundError("x", name="some_internal_module")) is None
    assert "expertcache[hf]" in missing_dependency_message(ModuleNotFoundError("x", name="transformers"))
