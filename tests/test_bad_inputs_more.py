"""Issue 32's bad inputs beyond the output rule (tests/test_outputs.py): bounds on every size and count flag, traces
with no accesses, model folders that would read outside themselves or alias bytes, JSON nested thousands deep.
Each is one error line naming the flag or the file, exit 2, before any long work; the same in-process table style as
tests/test_bad_inputs.py (whose fixtures it shares)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache.cli.main import main

import test_bad_inputs
from conftest import needs_shared_data

#: these run `expertcache eval`, which reads WikiText before it loads the model they test
needs_wikitext = needs_shared_data("wikitext-2-raw-v1")
from test_bad_inputs import SHIPPED, _check, _raw_trace
from test_trace_sim import make_trace

env, one_thread = test_bad_inputs.env, test_bad_inputs.one_thread  # the shared fixtures

DEEP = "[" * 5000 + "]" * 5000  # RecursionError in json.loads before


def test_size_and_count_flags_are_bounded(env, capsys):
    """Each crashed, hung or failed deep inside before: --threads 1999 segfaulted, --readers 100000 "can't start
    new thread", --seed 2**70 "Overflow when unpacking long long", --prefetch 1e9 "Cannot allocate memory",
    bench --tokens 1 ZeroDivisionError, --batch 100000 / --grid 1000000 / --samples 100000000 silent for minutes,
    analyze --max-batch 1e9 MemoryError."""
    tiny, tr = env["tiny"], env["trace"]
    huge = str(2**70)
    cases = [
        (["generate", "--model", tiny, "--threads", "1999", "1 2"], "--threads"),
        (["eval", "--task", "wikitext", "--threads", "1999"], "--threads"),
        (["generate", "--model", tiny, "--readers", "100000", "1 2"], "--readers"),
        (["generate", "--model", tiny, "--seed", huge, "1 2"], "--seed"),
        (["generate", "--model", tiny, "--prefetch", "1000000000", "1 2"], "--prefetch"),
        (["simulate", tr, "--initial", "random", "--seed", huge], "--seed"),
        (["analyze", tr, "--seed", huge], "--seed"),
        (["train", "--seed", huge], "--seed"),
        (["train", "--seq-len", "1"], "--seq-len"),
        (["bench", "--model", tiny, "--tokens", "1"], "--tokens"),
        (["bench", "--model", tiny, "--batch", "100000"], "--batch"),
        (["bench", "--model", tiny, "--prompt-seed", huge], "--prompt-seed"),
        (["sweep", "--trace", tr, "--out", env["root"] / "g.jsonl", "--grid", "1000000", "--dry-run"], "--grid"),
        (["analyze", tr, "--samples", "100000000"], "--samples"),
        (["analyze", tr, "--max-batch", "1000000000"], "--max-batch"),
        (["analyze", tr, "--max-batch", "120", "--samples", "100000"], "--samples"),
    ]
    for argv, culprit in cases:
        line = _check(argv, culprit, capsys)
        assert "≤" in line or "≥" in line, line  # the bound is said
    assert not (env["root"] / "g.jsonl").exists()


def test_bounds_leave_the_ordinary_values_alone(env, capsys):
    assert main(["analyze", env["trace"], "--max-batch", "120", "--samples", "4", "--json"]) == 0
    assert main(["simulate", env["trace"], "--initial", "random", "--seed", str(2**32 - 1)]) == 0
    capsys.readouterr()


def test_trace_with_no_accesses_is_refused(env, capsys, tmp_path):
    """Every selection -1: 'miss rate 0.0 %, Belady 0.0 %' from 0 accesses, and 'lifetime nan'."""
    good = make_trace(t=40)
    bad = _raw_trace(tmp_path / "none.trace", None, ids=np.full_like(good.ids_TLK, -1))
    for argv in (["simulate", bad, "--belady"], ["trace", "info", bad], ["analyze", bad],
                 ["sweep", "--trace", bad, "--policies", "original", "--out", tmp_path / "rows.jsonl", "--no-progress"]):
        _check(argv, "no accesses", capsys)
    assert not (tmp_path / "rows.jsonl").exists()


# -- JSON nested thousands deep: RecursionError wherever JSON was read ------------------------------------------


def test_deeply_nested_json_is_one_line_everywhere(env, capsys, tmp_path):
    from safetensors.numpy import save

    good = make_trace(t=40)
    trace = tmp_path / "deep.trace"
    trace.write_bytes(save({"logits": good.logits_TLE, "ids": good.ids_TLK.astype(np.int16)},
                           metadata={"expertcache_trace": DEEP}))
    _check(["simulate", trace], "nested deeper than", capsys)
    rows = tmp_path / "deep.jsonl"
    rows.write_text('{"miss_rate": 0.1, "quality": 1.0}\n' + DEEP + "\n")
    _check(["report", rows, "--out-dir", tmp_path / "figs"], "deep.jsonl:2", capsys)
    model = tmp_path / "deepcfg"
    shutil.copytree(SHIPPED, model)
    (model / "config.json").write_text(DEEP)
    _check(["generate", "--model", model, "--max-new-tokens", "2", "The kernel"], "config.json", capsys)
    data = tmp_path / "data" / "wikitext-2-raw-v1"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(DEEP + "\n")
    _check(["eval", "--model", "granular", "--task", "wikitext", "--limit", "1", "--data-dir", tmp_path / "data",
            "--no-progress"], "test.jsonl:1", capsys)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = edit(header)
    new = json.dumps(header).encode() if not isinstance(header, bytes) else header
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _model_copy(tmp_path, name) -> Path:
    dst = tmp_path / name
    shutil.copytree(SHIPPED, dst)
    return dst


def test_safetensors_header_nested_deep_names_the_file(tmp_path, capsys):
    bad = _model_copy(tmp_path, "deephdr")
    _rewrite_header(bad / "model.safetensors", lambda h: ("{" + '"a":' * 0 + '"x": ' + DEEP + "}").encode())
    _check(["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"], "model.safetensors", capsys)


@needs_wikitext
def test_tensors_sharing_bytes_are_refused(tmp_path, capsys):
    """Two tensors on one byte range were accepted; generation ran on the duplicated weights."""
    bad = _model_copy(tmp_path, "alias")

    def alias(h):
        keys = sorted((k for k in h if ".experts." in k), key=lambda k: h[k]["data_offsets"][0])
        a, b = keys[0], next(k for k in keys[1:] if h[k]["shape"] == h[keys[0]]["shape"])
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
        return h

    _rewrite_header(bad / "model.safetensors", alias)
    for argv in (["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"],
                 ["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--no-progress"]):
        _check(argv, "share bytes", capsys)


@needs_wikitext
@pytest.mark.parametrize("target", ["../outside/model.safetensors", "/etc/passwd"])
def test_shard_index_outside_the_folder_is_refused(tmp_path, capsys, target):
    bad = _model_copy(tmp_path, "shards")
    (tmp_path / "outside").mkdir()
    shutil.copy(SHIPPED / "model.safetensors", tmp_path / "outside" / "model.safetensors")
    (bad / "model.safetensors").unlink()
    from safetensors import safe_open

    with safe_open(str(SHIPPED / "model.safetensors"), framework="np") as f:
        keys = list(f.keys())
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in keys}}))
    for argv in (["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"],
                 ["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--no-progress"]):
        _check(argv, "not a file inside the model folder", capsys)


@needs_wikitext
def test_pickled_only_model_folder_is_one_line(tmp_path, capsys):
    """torch's 'Weights only load failed' traceback before."""
    bad = _model_copy(tmp_path, "pickled")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    for argv in (["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"],
                 ["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--no-progress"]):
        _check(argv, "pickled", capsys)


# -- tracebacks and unclear answers: MMLU files without questions, stdout closed or ASCII, empty --model, tokenizer ---


@pytest.mark.parametrize("content", ["", "question,choice0,choice1,choice2,choice3,answer\n"])
def test_mmlu_file_without_questions_is_named(tmp_path, capsys, content):
    """ZeroDivisionError before."""
    root = tmp_path / "data" / "mmlu"
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True)
    (root / "dev" / "os_dev.csv").write_text("question,choice0,choice1,choice2,choice3,answer\nq,a,b,c,d,0\n")
    (root / "test" / "os_test.csv").write_text(content)
    _check(["eval", "--model", "granular", "--task", "mmlu", "--limit", "1", "--data-dir", tmp_path / "data",
            "--no-progress"], "os_test.csv: no questions", capsys)


def _cli(args, **kw):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env_ = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                **kw.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, args)], env=env_,
                          stderr=subprocess.PIPE, timeout=120, **kw)


def test_closed_stdout_is_one_line(env):
    """``expertcache simulate T >&-``: AttributeError ('NoneType' object has no attribute 'write') before."""
    proc = _cli(["simulate", env["trace"]], stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err and "error: stdout is closed" in err, err


def test_output_encoding_that_cannot_write_the_text_names_stdout(env, capsys, monkeypatch, tmp_path):
    """PYTHONIOENCODING=ascii: "'ascii' codec can't encode character" did not say which side failed."""
    import io

    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    trace = tmp_path / "café.trace"  # the table names the trace
    shutil.copy(env["trace"], trace)
    code = main(["simulate", str(trace)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and "error: stdout:" in err and "PYTHONIOENCODING" in err, err


@needs_wikitext
def test_empty_model_name_is_refused(capsys, tmp_path, monkeypatch):
    """``--model ""`` read the current folder."""
    monkeypatch.chdir(tmp_path)
    _check(["generate", "--model", "", "The kernel"], "--model is empty", capsys)
    _check(["eval", "--model", "", "--task", "wikitext", "--limit", "1"], "--model is empty", capsys)


def test_tokenizer_config_missing_or_broken_is_blamed_on_itself(tmp_path, capsys):
    """A broken tokenizer_config.json was blamed on tokenizer.json; a missing one gave 'the tokenizer has 8193
    tokens'."""
    missing = _model_copy(tmp_path, "nocfg")
    (missing / "tokenizer_config.json").unlink()
    _check(["generate", "--model", missing, "--max-new-tokens", "2", "The kernel"], "tokenizer_config.json: not found",
           capsys)
    broken = _model_copy(tmp_path, "badcfg")
    (broken / "tokenizer_config.json").write_text('{"model_max_length": ')
    line = _check(["generate", "--model", broken, "--max-new-tokens", "2", "The kernel"], "tokenizer_config.json",
                  capsys)
    assert "tokenizer.json" not in line.replace("tokenizer_config.json", "")


def test_fifo_where_a_file_is_expected_is_refused_not_waited_on(tmp_path, capsys):
    """A FIFO as the trace blocked forever (no writer); a FIFO as config.json too."""
    fifo = tmp_path / "t.trace"
    os.mkfifo(fifo)
    for argv in (["simulate", fifo], ["trace", "info", fifo], ["analyze", fifo]):
        _check(argv, "not a regular file", capsys)
    model = _model_copy(tmp_path, "fifocfg")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    _check(["generate", "--model", model, "--max-new-tokens", "2", "The kernel"], "config.json: not a regular file", capsys)
