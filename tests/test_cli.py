"""The ``expertcache`` command line: simulate (table, --json, --out) and its error messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from expertcache.cli.main import build_parser, main
from expertcache.results import append_jsonl, read_jsonl

from test_trace_sim import make_trace


@pytest.fixture()
def trace_file(tmp_path):
    return str(make_trace(t=300).save(tmp_path / "t.trace"))


def test_simulate_table(trace_file, capsys):
    assert main(["simulate", trace_file, "--policy", "cache-prior", "--lam", "0.5", "--top-j", "1",
                 "--eviction", "lru", "--capacity", "0.5", "--belady"]) == 0
    out = capsys.readouterr().out
    assert "open loop" in out and "miss rate" in out and "Belady bound" in out
    assert out.count("%") >= 2 + 2 * 3  # overall + per-layer rows


def test_simulate_json_and_out(trace_file, tmp_path, capsys):
    out_file = tmp_path / "rows.jsonl"
    for lam in ("0.0", "0.6"):
        assert main(["simulate", trace_file, "--policy", "cache-prior", "--lam", lam, "--capacity", "4",
                     "--json", "--out", str(out_file)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = list(read_jsonl(out_file))
    assert [r["miss_rate"] for r in rows] == [r["miss_rate"] for r in printed]
    assert rows[0]["config"]["routing"]["lam"] == 0.0 and rows[1]["config"]["routing"]["lam"] == 0.6
    assert rows[1]["miss_rate"] < rows[0]["miss_rate"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity", "9"], "between 1 and N=8"),
        (["--capacity", "0"], "between 1 and N=8"),
        (["--policy", "cache-prior", "--lam", "1.5"], "lam must be in"),
        (["--policy", "cumsum", "--p", "-0.1"], "p must be in"),
        (["--policy", "cache-prior", "--lam", "0.5", "--eviction", "belady"], "belady"),
        (["--capacity", "abc"], "capacity must be"),
    ],
)
def test_simulate_bad_input_is_one_clear_line(trace_file, capsys, argv, message):
    assert main(["simulate", trace_file, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_and_corrupt_trace(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.trace")]) == 2
    assert "no trace file" in capsys.readouterr().err
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"\x00" * 64)
    assert main(["simulate", str(bad)]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_unknown_policy_is_rejected_by_the_parser(trace_file):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", trace_file, "--policy", "magic"])


def test_console_script_runs(trace_file):
    proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "simulate", trace_file, "--json"],
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["config"]["routing"]["policy"] == "original"


def test_jsonl_reader_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, {"a": 1})
    append_jsonl(path, {"a": 2})
    with open(path, "a") as f:
        f.write('{"a": 3, "b"')  # interrupted write
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
