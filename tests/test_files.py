"""Where files go and what they say: a private cache folder in tests, no absolute paths of the machine that made a
shipped asset, make_figures.sh writes only into its output folder unless told --update-docs."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "expertcache" / "assets"


def _strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def _metadata_strings(path: Path):
    """Every string in a safetensors file's metadata (JSON-valued entries are parsed)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        for value in (f.metadata() or {}).values():
            yield value
            try:
                yield from _strings(json.loads(value))
            except json.JSONDecodeError:
                pass


def test_shipped_assets_hold_no_absolute_paths():
    files = sorted(ASSETS.rglob("*.safetensors")) + sorted(ASSETS.rglob("*.json"))
    assert any(f.name.endswith(".trace.safetensors") for f in files) and any(f.name == "card.json" for f in files)
    bad = []
    for f in files:
        if f.suffix == ".json":
            strings = list(_strings(json.loads(f.read_text(encoding="utf-8"))))
            if f.name == "tokenizer.json":  # vocabulary entries are text, not paths
                strings = []
        else:
            strings = list(_metadata_strings(f))
        bad += [(f.relative_to(ROOT), s[:80]) for s in strings if s.startswith("/") or re.match(r"[A-Za-z]:\\", s)]
    assert not bad, bad


def test_trace_writer_stores_no_absolute_paths(tmp_path):
    from expertcache.trace import RoutingTrace
    from test_trace_sim import make_trace

    trace = make_trace(t=20)
    trace.meta.extra["patch"] = {"model": "/home/someone/models/olmoe-copy", "nested": ["/tmp/x/y.raw", "a/b"]}
    trace.meta.extra["text"] = "wikitext-2 test /not a path at the start"
    path = trace.save(tmp_path / "t.trace.safetensors")
    strings = list(_metadata_strings(path))
    assert not [s for s in strings if s.startswith("/")]
    back = RoutingTrace.load(path)
    assert back.meta.extra["patch"] == {"model": "olmoe-copy", "nested": ["y.raw", "a/b"]}
    assert back.meta.extra["text"] == "wikitext-2 test /not a path at the start"
    np.testing.assert_array_equal(back.ids_TLK, trace.ids_TLK)


def test_tests_use_a_private_cache_folder():
    cache = Path(os.environ["EXPERTCACHE_CACHE"])
    assert cache.is_dir() and not str(cache).startswith(str(Path.home() / ".cache"))
    from expertcache.offload.make_model import bench_models_dir

    assert bench_models_dir().parent == cache


def _mtimes(paths):
    return {p: p.stat().st_mtime_ns for base in paths for p in ([base] if base.is_file() else base.rglob("*"))}


def test_make_figures_writes_only_into_its_output_folder(tmp_path):
    """Every output path of every command the script runs lies under --out; tracked files are not touched."""
    script = ROOT / "benchmarks" / "make_figures.sh"
    tracked = [ROOT / "docs" / "results", ROOT / "docs" / "figures", ASSETS / "traces"]
    before = _mtimes(tracked)
    out = tmp_path / "figs"
    env = dict(os.environ, EXPERTCACHE_CMD="echo EC")
    proc = subprocess.run(["bash", str(script), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("EC ")]
    assert len(commands) >= 12
    outputs = [argv[i + 1] for argv in commands for i, a in enumerate(argv[:-1])
               if a in ("--out", "--out-dir", "--fig", "--trace-out")]
    assert len(outputs) >= 12 and all(o.startswith(str(out)) for o in outputs), outputs
    trace_reads = [argv[argv.index("--trace") + 1] for argv in commands if "--trace" in argv]
    assert trace_reads and all(t.startswith(str(out)) for t in trace_reads)  # the recorded demo trace, not the shipped one
    assert _mtimes(tracked) == before
    bad = subprocess.run(["bash", str(script), "--nonsense"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--update-docs" in bad.stderr


def test_quick_tour_outputs_are_ignored_by_git():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    tour = readme[readme.index("## Quick tour"):]
    tour = tour[:tour.index("```", tour.index("```bash") + 7)]
    paths = re.findall(r"--out(?:-dir)? (\S+)", tour)
    assert paths
    proc = subprocess.run(["git", "check-ignore", *paths, "out/make-figures/x.png"], cwd=ROOT, capture_output=True,
                          text=True)
    assert sorted(proc.stdout.split()) == sorted(paths + ["out/make-figures/x.png"]), proc.stdout


def test_readme_commands_and_ci_agree():
    """README's first block is set-up, main job, tests; the set-up extra brings every optional package (tests
    included); .ci/run runs exactly the README's test command after installing the same extra."""
    tomllib = pytest.importorskip("tomllib")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("```bash") + 7:readme.index("```", readme.index("```bash") + 7)]
    setup, job, test = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert setup.startswith("pip install") and job.startswith("expertcache generate") and test == "python -m pytest"
    extra = re.search(r'"\.\[(\w+)\]"', setup).group(1)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(reqs):
        return {re.split(r"[<>=!~\[ ]", r, 1)[0].lower().replace("-", "_") for r in reqs}

    # every extra but `peers` (benchmarks/bench_peers.py: llama-cpp-python builds llama.cpp from source, ~25 min;
    # not for CI)
    assert names(extras[extra]) >= {"pytest", "hypothesis"} | set().union(
        *(names(v) for k, v in extras.items() if k != "peers"))
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'-e ".[{extra}]"' in ci and test in [line.strip() for line in ci.splitlines()]
    from expertcache.cli.main import OPTIONAL_EXTRAS

    assert {e for e in OPTIONAL_EXTRAS.values()} <= set(extras)  # the messages name extras that exist
