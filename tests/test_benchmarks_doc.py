"""BENCHMARKS.md and benchmarks/ stay in step: every command the page cites exists and takes the options it is
given there, every cited script's --help runs, every script in benchmarks/ is cited by BENCHMARKS.md or docs/,
and every section with a table names a raw-rows file that is in the repository. No figure is recomputed.

Figures the lead has still to fill sit between ``<!-- lead: ... -->`` and ``<!-- /lead -->``: a script cited only
there (one another branch adds) may be missing; tables there need no rows file yet."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "BENCHMARKS.md"
SCRIPT_RE = re.compile(r"benchmarks/[\w.-]+\.(?:py|sh)\b")
RESULTS_RE = re.compile(r"(?:benchmarks|docs)/results/[\w.{},*/-]*[\w}*]")
LEAD_RE = re.compile(r"<!-- lead:.*?<!-- /lead -->", re.S)
#: scripts' --help run at once, and the limit of each (a hang, not a busy machine)
HELP_AT_ONCE, HELP_SECONDS = 2, 600


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _outside_lead(text: str) -> str:
    return LEAD_RE.sub("", text)


def _bash_commands(text: str) -> list[str]:
    """Every command line of the page's ```bash blocks (continuations joined, comments dropped), and every inline
    code span that is a command (starts with `expertcache ` or `python benchmarks/`)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)
            if re.match(r"(?:sudo )?(?:python )?(?:expertcache |benchmarks/)", " ".join(span.split()))]
    return out


def _expand(pattern: str) -> list[str]:
    """Brace alternatives ({a,b}) and globs of a cited path, as paths relative to the repository."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]
    if "*" in pattern:
        return [os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / pattern))]
    return [pattern]


def _invocations(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(program, sub-command words, --options) of every `expertcache ...` and `benchmarks/X ...` call in the
    page's bash blocks. Sub-command words: the bare words right after the program (no path, no variable)."""
    calls = []
    for line in _bash_commands(text):
        for part in re.split(r";|&&|\|", line):
            try:
                words = shlex.split(part.replace("[", " ").replace("]", " "))
            except ValueError:
                words = part.split()
            for i, w in enumerate(words):
                if w == "expertcache" or SCRIPT_RE.fullmatch(w):
                    rest = words[i + 1:]
                    subs = []
                    for r in rest:
                        if r.startswith("-") or "/" in r or "$" in r or "=" in r or "." in r:
                            break
                        subs.append(r)
                    opts = sorted({r.split("=")[0] for r in rest if r.startswith("--")})
                    calls.append((w, subs, opts))
                    break
    return calls


def _parser_options(parser: argparse.ArgumentParser, subs: list[str]) -> tuple[set[str], list[str]]:
    """Option strings of the (nested) sub-command ``subs`` of ``parser``, and the words that are no sub-command."""
    rest = list(subs)
    while rest:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or rest[0] not in actions[0].choices:
            break
        parser = actions[0].choices[rest.pop(0)]
    return {o for a in parser._actions for o in a.option_strings}, rest


def test_cited_expertcache_commands_exist_with_their_options():
    from expertcache.cli.main import HELP, build_parser

    calls = [c for c in _invocations(_text()) if c[0] == "expertcache"]
    assert {c[1][0] for c in calls} >= {"bench", "sweep", "report"}, calls
    for _, subs, opts in calls:
        assert subs and subs[0] in HELP, f"BENCHMARKS.md cites `expertcache {' '.join(subs)}`: no such command"
        options, extra = _parser_options(build_parser(only=subs[0]), subs)
        assert len(extra) <= 1, f"`expertcache {' '.join(subs)}`: unknown sub-command {extra}"  # one positional
        missing = [o for o in opts if o not in options]
        assert not missing, f"`expertcache {' '.join(subs)}` has no option {missing}"


def test_cited_scripts_exist_and_their_help_runs():
    text = _text()
    outside = set(SCRIPT_RE.findall(_outside_lead(text)))
    pending = set(SCRIPT_RE.findall(text)) - outside  # cited only where the lead still fills figures in
    assert outside, "BENCHMARKS.md cites no script"
    missing = sorted(s for s in outside if not (ROOT / s).is_file())
    assert not missing, f"BENCHMARKS.md cites scripts that do not exist: {missing}"
    scripts = sorted(s for s in outside | pending if (ROOT / s).is_file())
    # every script's --help, and that of each sub-command the page calls, in parallel (they import torch)
    helps = {(s, ()) for s in scripts}
    calls = [c for c in _invocations(text) if c[0] != "expertcache" and (ROOT / c[0]).is_file()]
    helps |= {(prog, tuple(subs)) for prog, subs, _ in calls if subs}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    # a few at a time (each imports torch): all at once under a wall-clock limit failed whenever the machine was
    # busy (load 19-35); each run has its own generous limit, counted from its own start
    from concurrent.futures import ThreadPoolExecutor

    def run_help(key):
        s, subs = key
        cmd = (["bash"] if s.endswith(".sh") else [sys.executable]) + [str(ROOT / s), *subs, "--help"]
        try:
            return key, subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HELP_SECONDS)
        except subprocess.TimeoutExpired:
            return key, None

    outputs = {}
    with ThreadPoolExecutor(max_workers=HELP_AT_ONCE) as pool:
        for key, p in pool.map(run_help, sorted(helps)):
            assert p is not None, f"{' '.join(key[:1] + key[1])} --help did not finish in {HELP_SECONDS} s"
            assert p.returncode == 0 and p.stdout.strip(), f"{key[0]} {' '.join(key[1])} --help failed: {p.stderr[-500:]}"
            outputs[key] = p.stdout
    # the options the page passes to a script are ones its --help lists
    for prog, subs, opts in calls:
        if prog.endswith(".py"):
            missing = [o for o in opts if o not in outputs[(prog, tuple(subs))]]
            assert not missing, f"BENCHMARKS.md passes {missing} to {prog} {' '.join(subs)}: not in its --help"


def test_every_benchmark_script_is_cited():
    cited = _text() + "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    scripts = [p for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert scripts
    uncited = sorted(p.name for p in scripts if f"benchmarks/{p.name}" not in cited)
    assert not uncited, f"not cited by BENCHMARKS.md or docs/: {uncited}"


def test_every_cited_results_file_exists():
    text = _text()
    cited = set(RESULTS_RE.findall(text))
    assert cited
    for pattern in cited:
        paths = _expand(pattern.rstrip("/"))
        assert paths and all((ROOT / p).exists() for p in paths), f"BENCHMARKS.md cites {pattern}: not in the repository"
    # bare file names in the question index (its rows start with a link) are files of benchmarks/ or docs/results
    index = "\n".join(line for line in text.splitlines() if line.startswith("| ["))
    assert index
    for name in set(re.findall(r"`([\w*-]+\.jsonl)`", index)):
        found = [p for d in ("benchmarks/results", "docs/results") for p in _expand(f"{d}/{name}")]
        assert any((ROOT / p).exists() for p in found), f"BENCHMARKS.md names {name}: no such results file"


def test_every_section_with_figures_names_its_rows():
    """A section (## or ###) that shows a table outside the lead's placeholders cites a results file that exists,
    and no section is named after an issue or a work round."""
    text = _outside_lead(_text())
    sections = re.split(r"\n(?=#{2,3} )", text)[1:]
    assert len(sections) >= 6
    for sec in sections:
        title = sec.splitlines()[0]
        assert not re.search(r"\b(issue|round|follow-up|branch)\b", title, re.I), f"section named after work: {title}"
        if re.search(r"^\|[-:| ]+\|$", sec, re.M):
            rows = [p for pat in RESULTS_RE.findall(sec) for p in _expand(pat.rstrip("/"))]
            assert rows and all((ROOT / p).exists() for p in rows), f"{title}: table without an existing rows file"


def test_make_figures_benchmarks_mode_covers_every_cited_script(tmp_path):
    """`make_figures.sh --benchmarks` runs (here: echoes) each BENCHMARKS.md speed measurement into --out, or names it
    as one to run by hand; nothing tracked is written."""
    env = dict(os.environ, EXPERTCACHE_CMD="echo EC", PYTHON_CMD="echo PY")
    out = tmp_path / "figs"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "make_figures.sh"), "--out", str(out), "--benchmarks"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    runs = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("PY ")]
    assert runs
    outputs = [argv[argv.index("--out") + 1] for argv in runs]
    assert len(outputs) == len(runs) and all(o.startswith(str(out)) for o in outputs), outputs
    covered = set(SCRIPT_RE.findall(proc.stdout))
    cited = set(SCRIPT_RE.findall(_outside_lead(_text()))) - {"benchmarks/make_figures.sh", "benchmarks/bench_quality.py"}
    assert cited <= covered, f"neither run nor listed by make_figures.sh --benchmarks: {sorted(cited - covered)}"
