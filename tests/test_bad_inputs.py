"""Every bad input -- file, flag, prompt, output path -- of every sub-command: exit code 2, ONE error line on
stderr that names the culprit (the flag or the file), no traceback, and nothing computed or written first.

Cases run in-process through ``expertcache.cli.main.main`` on tiny inputs (a synthetic trace, tiny random
models, a copy of the shipped granular model with one file damaged), so the whole table stays fast.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.cli.main import main
from expertcache.models.tiny import save_tiny

from test_trace_sim import make_trace

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "assets" / "models" / "granular"


@pytest.fixture(autouse=True)
def one_thread(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Shared inputs: a trace, a regular file (to put outputs 'under'), a tiny model, granular variants."""
    root = tmp_path_factory.mktemp("bad")
    e = {"root": root}
    e["trace"] = str(make_trace(t=120).save(root / "t.trace"))
    e["file"] = root / "plain.txt"
    e["file"].write_text("a regular file\n")
    e["tiny"] = save_tiny("olmoe", root / "tiny", seed=1)
    # a wikitext data folder whose file is not UTF-8 (line 2)
    bad_data = root / "data-bad" / "wikitext-2-raw-v1"
    bad_data.mkdir(parents=True)
    (bad_data / "test.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    e["bad_data"] = str(root / "data-bad")
    good_data = root / "data" / "wikitext-2-raw-v1"
    good_data.mkdir(parents=True)
    (good_data / "test.jsonl").write_text("\n".join(json.dumps({"text": "The kernel loads modules. " * 20})
                                                    for _ in range(40)) + "\n")
    e["data"] = str(root / "data")
    # granular variants, each with one damaged file
    for name in ("badjson", "mismatch", "notok", "badtok", "trunc"):
        shutil.copytree(SHIPPED, root / name)
    st = root / "trunc" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (root / "badjson" / "config.json").write_text('{"model_type": "olmoe", "hidden_size": 144,,}')
    cfg = json.loads((root / "mismatch" / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (root / "mismatch" / "config.json").write_text(json.dumps(cfg))
    (root / "notok" / "tokenizer.json").unlink()
    (root / "badtok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    for name in ("badjson", "mismatch", "notok", "badtok", "trunc"):
        e[name] = str(root / name)
    # a JSON file of something else, a JSONL file with a bad middle line, a truncated trace
    e["other_json"] = root / "other.json"
    e["other_json"].write_text(json.dumps({"name": "not rows", "values": [1, 2, 3]}) + "\n")
    e["bad_jsonl"] = root / "bad.jsonl"
    e["bad_jsonl"].write_text('{"miss_rate": 0.1, "quality": 1.0}\n{not json\n{"miss_rate": 0.2, "quality": 1.0}\n')
    e["nonutf8_jsonl"] = root / "latin1.jsonl"
    e["nonutf8_jsonl"].write_bytes(b'{"miss_rate": 0.1, "note": "caf\xe9"}\n')
    data = Path(e["trace"]).read_bytes()
    e["trunc_trace"] = root / "trunc.trace"
    e["trunc_trace"].write_bytes(data[: len(data) // 2])
    e["not_trace"] = root / "rows.trace"
    e["not_trace"].write_text('{"a": 1}\n')
    (root / "latin1.json").write_bytes(b'{"freq": "caf\xe9"}')
    np.save(root / "objects.npy", np.array([{"a": 1}], dtype=object))
    e["text_latin1"] = root / "latin1.txt"
    e["text_latin1"].write_bytes(b"plain ascii\nthen caf\xe9\n")
    return e


def _check(argv, culprit, capsys):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert culprit in errors[0], (culprit, errors[0])
    return errors[0]


# -- flags: (argv after the command's required inputs, text that must be in the error line) -----------------

SIMULATE_FLAGS = [
    (["--policy", "eras-threshold", "--alpha", "nan"], "--alpha"),
    (["--policy", "eras-threshold", "--alpha", "-0.5"], "--alpha"),
    (["--policy", "eras-bias", "--beta", "nan"], "--beta"),
    (["--policy", "eras-bias", "--beta", "inf"], "--beta"),
    (["--policy", "cache-prior", "--lam", "0.5", "--delta", "nan"], "--delta"),
    (["--policy", "cache-prior", "--lam", "0.5", "--delta", "-3"], "--delta"),
    (["--policy", "cache-prior", "--lam", "-0.1"], "--lam"),
    (["--policy", "cache-prior", "--lam", "nan"], "--lam"),
    (["--policy", "cumsum", "--p", "1.5"], "--p"),
    (["--policy", "max-rank", "--m", "-1"], "--m"),
    (["--policy", "max-rank", "--m", "99"], "m=99"),
    (["--policy", "prune", "--h", "0"], "--h"),
    (["--policy", "prune", "--h", "5"], "h=5"),
    (["--policy", "cache-prior", "--top-j", "-1"], "--top-j"),
    (["--policy", "cache-prior", "--top-j", "3"], "top-J=3"),
    (["--policy", "cache-prior", "--top-j", "x"], "--top-j"),
    (["--eviction", "gamma", "--gamma", "1.5"], "--gamma"),
    (["--eviction", "gamma", "--gamma", "nan"], "--gamma"),
    (["--capacity", "inf"], "--capacity"),
    (["--capacity", "nan"], "--capacity"),
    (["--capacity", "0"], "capacity"),
    (["--capacity", "-3"], "capacity"),
    (["--capacity", "99"], "capacity"),
    (["--capacity", "2.5"], "capacity"),
    (["--capacity", "1.5e3"], "capacity"),
    (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("flags, culprit", SIMULATE_FLAGS, ids=[" ".join(f) for f, _ in SIMULATE_FLAGS])
def test_simulate_flags(env, capsys, flags, culprit):
    _check(["simulate", env["trace"], *flags], culprit, capsys)


def test_routing_config_rejects_bad_values_for_library_users():
    from expertcache.routing import RoutingConfig

    for kw in (dict(alpha=math.nan), dict(beta=math.nan), dict(delta=math.nan), dict(delta=-3.0), dict(lam=-1.0),
               dict(p=math.inf), dict(m=-2), dict(h=0), dict(top_j=-1), dict(top_j=1.5)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            RoutingConfig("cache-prior", **kw)


def test_each_policy_defaults_to_its_papers_top_j(env, capsys):
    """001's policies keep the top-1; 003's ERAS policies have no such guarantee -- and the run says so."""
    from expertcache.routing import RoutingConfig

    assert RoutingConfig("cache-prior", lam=0.5).top_j == 1
    assert RoutingConfig("max-rank", m=4).top_j == 1
    assert RoutingConfig("eras-threshold", alpha=0.2).top_j == 0
    assert RoutingConfig("eras-bias", beta=1.0).top_j == 0
    assert RoutingConfig("eras-threshold", alpha=0.2, top_j=2).top_j == 2
    assert main(["simulate", env["trace"], "--policy", "eras-threshold", "--alpha", "0.3", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["config"]["routing"]["top_j"] == 0
    assert "eras-threshold(alpha=0.3,J=0)" in cap.err  # the resolved configuration, printed


# -- output paths: a folder, under a regular file -- refused before any work -------------------------------


def _out_cases(env):
    d, f = env["root"], env["file"]
    under = f / "x.jsonl"
    tr = env["trace"]
    return [
        (["simulate", tr, "--out", d], "--out"),
        (["simulate", tr, "--out", under], "--out"),
        (["sweep", "--trace", tr, "--policies", "original", "--out", d], "--out"),
        (["sweep", "--trace", tr, "--policies", "original", "--out", under], "--out"),
        (["report", env["bad_jsonl"], "--out-dir", f], "--out-dir"),
        (["report", env["bad_jsonl"], "--out-dir", f / "figs"], "--out-dir"),
        (["eval", "--task", "wikitext", "--out", d], "--out"),
        (["eval", "--task", "wikitext", "--trace-out", under], "--trace-out"),
        (["trace", "record", "--out", d], "--out"),
        (["trace", "record", "--out", under], "--out"),
        (["analyze", tr, "--out-dir", f], "--out-dir"),
        (["analyze", tr, "--profile-out", d], "--profile-out"),
        (["sensitivity", "--fig", under], "--fig"),
        (["bench", "--model", env["tiny"], "--out", d], "--out"),
        (["bench", "--make-model", "olmoe-1b-7b", "--out-dir", f], "--out-dir"),
        (["mole", "eval", env["tiny"], "--out", d], "--out"),
        (["mole", "export", env["tiny"], "--out", f], "--out"),
        (["train", "--out", f / "run"], "--out"),
        (["melinoe", "finetune", "--out", f / "run"], "--out"),
        (["melinoe", "predictor", "--out", f / "pred"], "--out"),
    ]


def _new_command_flag_cases(env):
    """Flags of serve, melinoe, the runtime's I/O, --predictor and the budget controller."""
    return [
        (["serve", "--port", "-1"], "--port"),
        (["serve", "--port", "0", "--max-batch", "0"], "--max-batch"),
        (["serve", "--port", "0", "--trace-dir", env["root"] / "missing"], "--trace-dir"),
        (["generate", "--readers", "-1", "hello"], "--readers"),
        (["generate", "--expert-product", "grouped", "hello"], "--expert-product"),
        (["bench", "--model", env["tiny"], "--expert-product", "mm"], "--expert-product"),
        (["generate", "--prefetch", "-3", "hello"], "--prefetch"),
        (["generate", "--threads", "0", "hello"], "--threads"),
        (["generate", "--predictor", env["root"] / "missing", "hello"], "--predictor"),
        (["melinoe", "finetune", "--steps", "0"], "--steps"),
        (["simulate", env["trace"], "--target-miss-rate", "-1"], "--target-miss-rate"),
        (["eval", "--task", "wikitext", "--target-miss-rate", "2"], "--target-miss-rate"),
    ]


def test_new_command_flags(env, capsys):
    for argv, culprit in _new_command_flag_cases(env):
        _check(argv, culprit, capsys)


def test_compile_without_a_cxx_compiler_is_refused_before_loading(env, capsys, monkeypatch, tmp_path):
    """``--compile`` builds C++ through torch.compile: with no compiler on PATH (nor ``$CXX``) the command stops
    at once with one line naming ``--compile``, not with inductor's traceback at the first token; the library
    refuses the same configuration before building anything."""
    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    line = _check(["generate", "--model", env["tiny"], "--compile", "5 6 7"], "--compile", capsys)
    assert "C++ compiler" in line
    with pytest.raises(ValueError, match="--compile needs a C\\+\\+ compiler"):
        OffloadedModel.from_pretrained(env["tiny"], OffloadConfig(tier="host", compile=True))
    monkeypatch.setenv("CXX", "/no/such/c++")
    assert "/no/such/c++" in _check(["bench", "--model", env["tiny"], "--compile"], "--compile", capsys)


def test_expert_kernel_variable_and_non_shipped_ship_are_refused_before_the_work(env, capsys, monkeypatch, tmp_path):
    """$EXPERTCACHE_EXPERT_KERNEL (forces the int4 experts' product) must name a kernel; ``train --ship`` of a
    preset that is not shipped (granular-256) is refused before training, writing nothing."""
    monkeypatch.setenv("EXPERTCACHE_EXPERT_KERNEL", "bogus")
    line = _check(["generate", "--quant", "int4", "--max-new-tokens", "2", "hello"], "EXPERTCACHE_EXPERT_KERNEL", capsys)
    assert "bogus" in line and "q4x8" in line  # the choices listed
    monkeypatch.delenv("EXPERTCACHE_EXPERT_KERNEL")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT4_KERNEL", "bogus")  # forces the int4 dense part's product
    line = _check(["generate", "--quant", "int4", "--quant-dense", "int4", "--max-new-tokens", "2", "hello"],
                  "EXPERTCACHE_DENSE_INT4_KERNEL", capsys)
    assert "bogus" in line and "int4pack" in line and "q4x8" in line
    monkeypatch.delenv("EXPERTCACHE_DENSE_INT4_KERNEL")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "bogus")  # forces the int8 dense part's product
    line = _check(["generate", "--quant", "q4", "--max-new-tokens", "2", "hello"], "EXPERTCACHE_DENSE_INT8_KERNEL", capsys)
    assert "bogus" in line and "fbgemm" in line and "q8x8" in line
    monkeypatch.delenv("EXPERTCACHE_DENSE_INT8_KERNEL")
    monkeypatch.setenv("EXPERTCACHE_FUSED_MOE", "bogus")  # turns the fused one-token MoE step (q4moe.py) on/off
    line = _check(["generate", "--quant", "int4", "--max-new-tokens", "2", "hello"], "EXPERTCACHE_FUSED_MOE", capsys)
    assert "bogus" in line
    monkeypatch.delenv("EXPERTCACHE_FUSED_MOE")
    monkeypatch.setenv("EXPERTCACHE_HOST_NORM", "bogus")  # turns the one-token RMSNorm kernel (hostnorm.py) on/off
    line = _check(["generate", "--quant", "q4", "--max-new-tokens", "2", "hello"], "EXPERTCACHE_HOST_NORM", capsys)
    assert "bogus" in line
    monkeypatch.delenv("EXPERTCACHE_HOST_NORM")
    _check(["train", "--model", "granular-256", "--ship", "--steps", "1", "--out", tmp_path / "run"], "--ship", capsys)
    assert not (tmp_path / "run").exists()


def test_output_paths_are_checked_before_any_work(env, capsys):
    for argv, culprit in _out_cases(env):
        _check(argv, culprit, capsys)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root may write anywhere")
def test_unwritable_output_folder(env, capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _check(["simulate", env["trace"], "--out", ro / "rows.jsonl"], "--out", capsys)
    finally:
        ro.chmod(0o700)


# -- input files -------------------------------------------------------------------------------------------


def test_bad_input_files(env, capsys):
    e = env
    cases = [
        (["simulate", e["trunc_trace"]], "trunc.trace"),
        (["simulate", e["not_trace"]], "rows.trace"),
        (["simulate", e["trace"], "--policy", "eras-bias", "--beta", "1", "--freq-from", e["root"] / "nope.npy"],
         "--freq-from"),
        (["trace", "info", e["trunc_trace"]], "trunc.trace"),
        (["simulate", e["trace"], "--policy", "eras-bias", "--beta", "1", "--freq-from", e["root"] / "latin1.json"],
         "latin1.json"),
        (["simulate", e["trace"], "--policy", "eras-bias", "--beta", "1", "--freq-from", e["root"] / "objects.npy"],
         "objects.npy"),
        (["analyze", e["not_trace"]], "rows.trace"),
        (["report", e["other_json"], "--out-dir", e["root"] / "rep1"], "other.json"),
        (["report", e["bad_jsonl"], "--out-dir", e["root"] / "rep2"], "bad.jsonl:2"),
        (["report", e["nonutf8_jsonl"], "--out-dir", e["root"] / "rep3"], "latin1.jsonl"),
        (["report", e["root"] / "missing.jsonl", "--out-dir", e["root"] / "rep4"], "missing.jsonl"),
        (["sweep", "--trace", e["trunc_trace"], "--policies", "original", "--out", e["root"] / "s0.jsonl"],
         "trunc.trace"),
        (["trace", "record", "--task", "text-file", "--file", e["text_latin1"], "--out", e["root"] / "r.trace"],
         "latin1.txt:2"),
    ]
    for argv, culprit in cases:
        _check(argv, culprit, capsys)
    assert not (e["root"] / "rep1").exists() and not (e["root"] / "r.trace").exists()


@pytest.mark.parametrize("name, culprit", [("badjson", "config.json: not valid JSON"), ("mismatch", "intermediate_size=96"),
                                           ("notok", "tokenizer.json"), ("badtok", "tokenizer.json"),
                                           ("trunc", "model.safetensors")])
def test_damaged_model_folders(env, capsys, name, culprit):
    line = _check(["eval", "--model", env[name], "--task", "wikitext", "--limit", "1", "--data-dir", env["data"],
                   "--no-progress"], culprit, capsys)
    assert name in line  # the folder is named too
    if name in ("mismatch", "badjson"):
        _check(["mole", "generate", env[name], "The kernel", "--max-new-tokens", "2"], culprit, capsys)
    if name not in ("mismatch", "trunc"):
        _check(["generate", "--model", env[name], "--max-new-tokens", "2", "The kernel"], culprit, capsys)


def test_non_utf8_data_file_names_file_and_line(env, capsys):
    _check(["eval", "--model", "granular", "--task", "wikitext", "--limit", "1", "--data-dir", env["bad_data"],
            "--no-progress"], "test.jsonl:2", capsys)


# -- counts and numbers of eval / generate / bench / sweep / report / mole / train --------------------------


def test_count_and_number_flags(env, capsys):
    tiny, tr = env["tiny"], env["trace"]
    cases = [
        (["eval", "--task", "wikitext", "--limit", "0"], "--limit"),
        (["eval", "--task", "wikitext", "--limit", "-1"], "--limit"),
        (["eval", "--task", "gsm8k", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["eval", "--task", "mmlu", "--shots", "-2"], "--shots"),
        (["eval", "--task", "wikitext", "--threads", "0"], "--threads"),
        (["eval", "--task", "wikitext", "--replace-rank", "0"], "--replace-rank"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--limit", "0"], "--limit"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--grid", "0"], "--grid"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--beta-max", "nan"], "--beta-max"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--top-j", "-1"], "--top-j"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--delta", "-3"], "--delta"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--capacity", "0.5,inf"], "--capacity"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--strengths", "0.1,nan"], "--strengths"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--policies", "magic"], "--policies"),
        (["sweep", "--trace", tr, "--out", env["root"] / "s.jsonl", "--eviction", "fifo"], "--eviction"),
        (["report", env["bad_jsonl"], "--out-dir", env["root"] / "r", "--tokens", "0"], "--tokens"),
        (["report", env["bad_jsonl"], "--out-dir", env["root"] / "r", "--layer", "-1"], "--layer"),
        (["analyze", tr, "--samples", "0"], "--samples"),
        (["report", env["bad_jsonl"], "--out-dir", env["root"] / "r", "--prefix", "../up-"], "--prefix"),
        (["sensitivity", "--fig", env["root"] / "fig.foo"], "--fig"),
        (["trace", "record", "--out", env["root"] / "x.trace", "--tokens", "0"], "--tokens"),
        (["trace", "info", tr, "--capacity", "nan"], "--capacity"),
        (["generate", "--model", tiny, "--max-new-tokens", "0", "1 2"], "--max-new-tokens"),
        (["generate", "--model", tiny, "--max-new-tokens", "-5", "1 2"], "--max-new-tokens"),
        (["generate", "--model", tiny, "--temperature", "-1", "1 2"], "--temperature"),
        (["generate", "--model", tiny, "--temperature", "nan", "1 2"], "--temperature"),
        (["generate", "--model", tiny, "--memory", "lots", "1 2"], "--memory"),
        (["generate", "--model", tiny, "--memory", "0", "1 2"], "--memory"),
        (["generate", "--model", tiny, "--cache-experts", "0", "1 2"], "--cache-experts"),
        (["generate", "--model", tiny, "--cache-experts", "99", "1 2"], "--cache-experts"),
        (["generate", "--model", tiny, "--quant", "int8", "--group", "0", "1 2"], "--group"),
        (["generate", "--model", tiny, "--quant", "int8", "--group", "-4", "1 2"], "--group"),
        (["generate", "--model", tiny, "--quant", "int8", "--group", "7", "1 2"], "--group"),
        (["generate", "--model", tiny, "--quant", "int8", "--group", "32", "1 2"], "--group"),
        (["generate", "--model", tiny, "--quant", "int4", "--group", "16", "1 2"], "--group"),
        (["generate", "--model", tiny, "--quant-dense", "int3", "1 2"], "--quant-dense"),
        (["generate", "--model", tiny, "--gamma", "2", "1 2"], "--gamma"),
        (["generate", "--model", tiny, "--threads", "0", "1 2"], "--threads"),
        (["generate", "--model", tiny, "--policy", "eras-threshold", "--alpha", "nan", "1 2"], "--alpha"),
        (["generate", "--model", tiny, "999 2"], "999"),
        (["generate", "--model", tiny, "hello"], "tokenizer.json"),
        (["bench", "--model", tiny, "--tokens", "0"], "--tokens"),
        (["bench", "--model", tiny, "--repeats", "0"], "--repeats"),
        (["bench", "--model", tiny, "--batch", "0"], "--batch"),
        (["bench", "--model", tiny, "--prompt-tokens", "-1"], "--prompt-tokens"),
        (["bench", "--model", tiny, "--prompt-tokens", "200", "--tokens", "100"], "--tokens"),
        (["mole", "eval", tiny, "--batches", "1,0"], "--batches"),
        (["mole", "generate", tiny, "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["mole", "train", "--lr", "nan"], "--lr"),
        (["train", "--lr", "inf"], "--lr"),
        (["train", "--steps", "-3"], "--steps"),
    ]
    for argv, culprit in cases:
        _check(argv, culprit, capsys)


# -- prompts past the context ------------------------------------------------------------------------------


def test_prompt_or_generation_past_the_context_is_refused(capsys):
    line = _check(["generate", "--model", "granular", "The kernel " * 10_000], "max_position_embeddings", capsys)
    assert "256" in line
    _check(["generate", "--model", "granular", "--max-new-tokens", "256", "The kernel loads the module"],
           "--max-new-tokens", capsys)
    assert "Token indices" not in capsys.readouterr().err


# -- silently wrong before: NaN weights, duplicated sweeps, damaged quantised experts -----------------------


def _nan_experts(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    for k in w:
        if ".experts." in k:
            w[k] = torch.full_like(w[k], float("nan"))
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_nan_weights_stop_generation(env, capsys, tmp_path):
    bad = _nan_experts(env["tiny"], tmp_path / "nan")
    _check(["generate", "--model", bad, "--io", "cached", "--max-new-tokens", "3", "1 2 3"], "non-finite", capsys)


def test_nan_weights_stop_eval(tmp_path, capsys, env):
    bad = _nan_experts(SHIPPED, tmp_path / "nan-granular")
    _check(["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--data-dir", env["data"],
            "--no-progress"], "non-finite", capsys)


def test_second_sweep_on_the_same_file_is_refused(env, capsys, tmp_path):
    out = tmp_path / "rows.jsonl"
    fd = os.open(str(out) + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another sweep holds the file
        line = _check(["sweep", "--trace", env["trace"], "--policies", "original", "--out", out, "--no-progress"],
                      "rows.jsonl", capsys)
        assert "another sweep" in line and not out.exists()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert main(["sweep", "--trace", env["trace"], "--policies", "original", "--out", str(out),
                 "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_report_counts_a_repeated_configuration_once(env, capsys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    assert main(["sweep", "--trace", env["trace"], "--policies", "original,cache-prior", "--strengths", "0.5",
                 "--out", str(rows), "--no-progress"]) == 0
    text = rows.read_text()
    twice = tmp_path / "twice.jsonl"
    twice.write_text(text + text)  # e.g. two sweeps appended before the lock existed
    capsys.readouterr()
    assert main(["report", str(twice), "--out-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "2 row(s) repeat a configuration" in err
    assert (tmp_path / "a" / "pareto.md").read_text().count("| 1 |") >= 1
    assert "| 2 |" not in (tmp_path / "a" / "pareto.md").read_text()


def test_report_refuses_rows_without_quality(env, capsys, tmp_path):
    rows = tmp_path / "sim.jsonl"
    assert main(["simulate", env["trace"], "--json", "--out", str(rows)]) == 0
    _check(["report", rows, "--out-dir", tmp_path / "r"], "sim.jsonl", capsys)


def test_quant_default_group_works_on_every_shipped_model(capsys):
    from expertcache.assets import SHIPPED_MODELS, shipped_model_dir
    from expertcache.offload.quant import default_group

    for name in SHIPPED_MODELS:
        cfg = json.loads((shipped_model_dir(name) / "config.json").read_text())
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        assert d % 64  # the old fixed default (64) could not quantise it
        assert main(["generate", "--model", name, "--quant", "int4", "--io", "cached", "--max-new-tokens", "2",
                     "--json", "The kernel"]) == 0
        row = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        g = row["config"]["group"]  # 32: K zero-padded to it (the kernels take G in 32..256)
        assert row["config"]["quant"] == "int4" and g == default_group(d, f) == 32
        assert "zero-padded: gate_up K 144->160" in row["config"]["quant_kernel"]


def test_bit_flipped_quantised_experts_are_rebuilt_or_refused(env, capsys, tmp_path, monkeypatch):
    from expertcache.offload.checkpoint import read_header
    from expertcache.offload import store

    monkeypatch.setattr(store, "_VERIFIED", set())
    model = tmp_path / "m"
    shutil.copytree(env["tiny"], model)
    argv = ["generate", "--model", str(model), "--quant", "int8", "--io", "cached", "--max-new-tokens", "4",
            "--temperature", "0", "1 2 3"]
    assert main(argv) == 0
    want = capsys.readouterr().out
    side = next((tmp_path / "cache" / "quant").glob("*.safetensors"))

    def flip(path):
        e = read_header(path)["model.layers.1.experts.3.qblob"]
        with open(path, "r+b") as f:
            f.seek(e.start + 5)
            b = f.read(1)
            f.seek(e.start + 5)
            f.write(bytes([b[0] ^ 0x10]))
        store._VERIFIED.clear()

    flip(side)  # in the cache: detected and rebuilt, same text as before
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "experts.3.qblob fails its checksum" in cap.err and "rebuilding" in cap.err
    assert cap.out == want
    # next to the model (never rewritten by expertcache): refused, naming the file
    shutil.copy(side, model / side.name.split("-", 2)[-1])
    flip(model / side.name.split("-", 2)[-1])
    _check(argv, "fails its checksum", capsys)


def test_flags_are_checked_before_the_trace_is_read(env, capsys):
    """A bad flag wins over a long computation: the (missing) trace is never opened."""
    _check(["simulate", env["root"] / "missing.trace", "--alpha", "nan", "--policy", "eras-threshold"], "--alpha",
           capsys)
    _check(["simulate", env["root"] / "missing.trace", "--out", env["root"]], "--out", capsys)


def test_expected_group_default():
    from expertcache.offload.quant import default_group

    assert default_group(144, 104) == 32 and default_group(2048, 1024) == 64 and default_group(32, 48) == 32
    assert np.all([default_group(d, f) in (32, 64) for d in (1, 7, 13) for f in (3, 5)])


def test_module_entry_point_reports_usage_errors(env):
    """``python -m expertcache.cli.main`` (a second copy of the module) still turns UsageError into exit 2."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "simulate", env["trace"], "--out",
                           str(env["root"])], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--out" in proc.stderr.strip().splitlines()[-1]


def test_missing_model_folder_is_named(env, capsys):
    _check(["eval", "--model", env["root"] / "nope", "--task", "wikitext", "--data-dir", env["data"]], "--model",
           capsys)
    _check(["generate", "--model", env["root"] / "nope", "hi"], "nope", capsys)
    # a bare word that is neither a shipped model, a hub name nor a folder: the one resolver names the flag
    _check(["eval", "--model", "nosuchmodel", "--task", "wikitext", "--data-dir", env["data"]], "--model", capsys)
    _check(["generate", "--model", "nosuchmodel", "hi"], "--model", capsys)
    _check(["bench", "--model", "nosuchmodel", "--tokens", "2"], "--model", capsys)


def test_unwritable_location_is_refused_without_root(env, monkeypatch):
    """The permission branch of check_output_path (the suite may run as root, who may write anywhere)."""
    from expertcache.cli.common import check_output_path
    from expertcache.cli.main import UsageError

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(UsageError, match="--out .*permission denied"):
        check_output_path(env["root"] / "new.jsonl", "--out")
    with pytest.raises(UsageError, match="--out .*not writable"):
        check_output_path(env["file"], "--out")


# -- issue 27: a fresh user's bad inputs (each failed on 17679b3: traceback, hang or silently wrong) ------------


def _granular_variant(tmp_path, name, config=None, tokenizer_of=None) -> str:
    """A copy of the shipped granular model (weights hard-linked) with ``config`` keys replaced and/or the
    tokenizer files of another folder."""
    dst = tmp_path / name
    dst.mkdir()
    for f in SHIPPED.iterdir():
        (os.link if f.suffix == ".safetensors" else shutil.copy)(f, dst / f.name)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tokenizer_of is not None:
        for n in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_of) / n, dst / n)
    return str(dst)


BAD_CONFIGS = [
    ({"intermediate_size": -104}, "intermediate_size must be an integer >= 1, got -104"),
    ({"hidden_size": "144"}, 'hidden_size must be an integer >= 1, got "144"'),
    ({"num_attention_heads": 4.5}, "num_attention_heads"),
    ({"vocab_size": True}, "vocab_size"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer >= 1, got 0"),
    ({"num_experts_per_tok": 33}, "num_experts_per_tok=33 must be in [1, num_experts=32]"),
    ({"num_hidden_layers": 1_000_000}, "num_hidden_layers=1000000"),  # hung: minutes building a meta model
    ({"hidden_act": "nope"}, 'hidden_act "nope" is not an activation'),  # KeyError traceback
    ({"tie_word_embeddings": "yes"}, "config.json: not a valid config"),  # was blamed on tokenizer.json
    ({"model_type": 5}, "config.json: not a valid config"),
]


@pytest.mark.parametrize("config, culprit", BAD_CONFIGS, ids=[next(iter(c)) + "=" + str(next(iter(c.values())))
                                                             for c, _ in BAD_CONFIGS])
def test_malformed_config_keys_name_file_and_key(env, capsys, tmp_path, config, culprit):
    bad = _granular_variant(tmp_path, "cfg", config)
    for argv in (["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--data-dir", env["data"], "--no-progress"],
                 ["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"],
                 ["bench", "--model", bad, "--tokens", "2", "--repeats", "1", "--policies", "original+lru"]):
        line = _check(argv, culprit, capsys)
        assert str(Path(bad) / "config.json") in line, line


def test_config_size_check_passes_every_shipped_and_tiny_model(env):
    from expertcache.assets import SHIPPED_MODELS, shipped_model_dir
    from expertcache.models.loader import read_config_json
    from expertcache.models.tiny import TINY_ARCHS

    for name in SHIPPED_MODELS:
        read_config_json(shipped_model_dir(name))
    for arch in TINY_ARCHS:
        read_config_json(save_tiny(arch, env["root"] / "tiny-all" / arch, seed=0))


@pytest.mark.parametrize("prompt, culprit", [("caf\udce9", "not valid UTF-8 (byte 0xe9 at character 3)"),
                                             ("a\ud800b", "lone surrogate U+D800 at character 1")])
def test_prompt_that_is_not_text(env, capsys, prompt, culprit):
    """A command-line prompt with bytes that are not UTF-8 (Python passes them as lone surrogates) or a lone
    surrogate: the tokenizer raised a TypeError (traceback)."""
    line = _check(["generate", "--max-new-tokens", "2", prompt], culprit, capsys)
    assert "prompt" in line
    _check(["mole", "generate", env["tiny"], prompt, "--max-new-tokens", "2"], culprit, capsys)


@pytest.mark.parametrize("body", [{"model": "granular", "prompt": "caf\ud800"},
                                  {"model": "granular", "messages": [{"role": "user", "content": "caf\udce9"}]}])
def test_http_prompt_that_is_not_text_is_a_400(body):
    """The same through the HTTP API (JSON ``"\\ud800"``): a 400 naming the prompt, not a 500."""
    from expertcache.models.loader import load_tokenizer_checked
    from expertcache.serve.app import ServeError, Validator

    v = Validator(["granular"], load_tokenizer_checked(SHIPPED), 256, 8192)
    with pytest.raises(ServeError) as exc:
        v.parse(json.loads(json.dumps(body)), chat="messages" in body)
    assert exc.value.status == 400 and "prompt" in str(exc.value) and "not valid" in str(exc.value)


def test_tokenizer_larger_than_the_embedding_is_refused(env, capsys, tmp_path):
    """ids past the embedding: IndexError inside the model (generate and eval) before."""
    from tokenizers import Tokenizer

    bad = _granular_variant(tmp_path, "bigtok")
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    tok.add_tokens([f"<extra{i}>" for i in range(16)])  # ids 8192..8207 of an 8192-row embedding
    tok.save(str(Path(bad) / "tokenizer.json"))
    culprit = "the tokenizer has 8208 tokens (ids up to 8207), the model's embedding only 8192 rows"
    _check(["generate", "--model", bad, "--max-new-tokens", "2", "The <extra3> kernel"], culprit, capsys)
    _check(["eval", "--model", bad, "--task", "wikitext", "--limit", "1", "--data-dir", env["data"], "--no-progress"],
           culprit, capsys)


def test_tokenizer_smaller_than_the_vocabulary_warns(tmp_path, capsys):
    """A 104-token tokenizer on the 8192-token granular model generated garbage silently: now one warning line."""
    import warnings

    from expertcache.eval.synthetic import char_tokenizer

    small = tmp_path / "chartok"
    char_tokenizer().save_pretrained(small)
    bad = _granular_variant(tmp_path, "smalltok", tokenizer_of=small)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["generate", "--model", bad, "--max-new-tokens", "2", "The kernel"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and "tokenizer.json: the tokenizer has 104 tokens, the model's vocabulary 8192" in lines[0]


def _raw_trace(path: Path, meta, logits=None, ids=None) -> Path:
    """A trace file written around the library's checks: any metadata JSON, any logits."""
    from dataclasses import asdict

    from safetensors.numpy import save

    good = make_trace(t=40)
    z = good.logits_TLE if logits is None else logits
    i = good.ids_TLK if ids is None else ids
    m = asdict(good.meta) if meta is None else meta
    if callable(m):
        m = m(asdict(good.meta))
    path.write_bytes(save({"logits": z.astype(np.float32), "ids": i.astype(np.int16)},
                          metadata={"expertcache_trace": json.dumps(m)}))
    return path


BAD_TRACE_META = [
    ("starts-string", lambda m: {**m, "sequence_starts": [0, "5"]}, "sequence_starts must be a list of integers"),
    ("meta-list", [1, 2, 3], "trace metadata must be a JSON object, got a JSON list"),
    ("layer-ids-int", lambda m: {**m, "layer_ids": 3}, "layer_ids must be a list of integers"),
    ("experts-string", lambda m: {**m, "num_experts": "8"}, 'num_experts must be an integer >= 0, got "8"'),
    ("renormalize-string", lambda m: {**m, "renormalize": "yes"}, "renormalize must be true or false"),
    ("extra-list", lambda m: {**m, "extra": []}, "extra must be a JSON object"),
    ("scoring-other", lambda m: {**m, "scoring": "relu"}, "scoring must be"),
]


@pytest.mark.parametrize("name, meta, culprit", BAD_TRACE_META, ids=[c[0] for c in BAD_TRACE_META])
def test_trace_metadata_of_the_wrong_type(env, capsys, tmp_path, name, meta, culprit):
    bad = _raw_trace(tmp_path / f"{name}.trace", meta)
    for argv in (["simulate", bad], ["trace", "info", bad], ["analyze", bad],
                 ["sweep", "--trace", bad, "--policies", "original", "--out", tmp_path / "rows.jsonl", "--no-progress"]):
        line = _check(argv, culprit, capsys)
        assert bad.name in line, line
    assert not (tmp_path / "rows.jsonl").exists()


def test_trace_with_inf_logits_is_refused_like_nan(env, capsys, tmp_path):
    """+inf logits were accepted (a 0 % miss layer; sweep: 'Out of range float values are not JSON compliant')."""
    z = make_trace(t=40).logits_TLE.copy()
    z[7, 1, 3] = np.inf
    bad = _raw_trace(tmp_path / "inf.trace", None, logits=z)
    for argv in (["simulate", bad, "--belady"], ["analyze", bad],
                 ["sweep", "--trace", bad, "--policies", "original", "--out", tmp_path / "rows.jsonl", "--no-progress"]):
        _check(argv, "logits contain +inf (token 7, layer 1, expert 3)", capsys)
    assert not (tmp_path / "rows.jsonl").exists()
    z[7, 1, 3] = -np.inf  # a zero probability: a valid routing
    _raw_trace(tmp_path / "neginf.trace", None, logits=z)
    assert main(["simulate", str(tmp_path / "neginf.trace")]) == 0


def test_trace_of_zero_tokens_is_refused(env, capsys, tmp_path):
    """It reported 'miss rate 0.0 %, Belady 0.0 %'."""
    good = make_trace(t=40)
    bad = _raw_trace(tmp_path / "empty.trace", lambda m: {**m, "num_tokens": 0},
                     logits=good.logits_TLE[:0], ids=good.ids_TLK[:0])
    for argv in (["simulate", bad, "--belady"], ["analyze", bad], ["trace", "info", bad],
                 ["sweep", "--trace", bad, "--policies", "original", "--out", tmp_path / "rows.jsonl", "--no-progress"]):
        _check(argv, "empty.trace: the trace holds 0 tokens", capsys)


@pytest.mark.parametrize("value", [None, 12345, ["a"]])
def test_wikitext_row_that_is_not_text_is_named(env, capsys, tmp_path, value):
    """A null or a number was scored as the text "None" / "12345"."""
    folder = tmp_path / "data" / "wikitext-2-raw-v1"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    _check(["eval", "--model", "granular", "--task", "wikitext", "--limit", "1", "--data-dir", tmp_path / "data",
            "--no-progress"], f"test.jsonl:2: 'text' must be a string, got {json.dumps(value)}", capsys)


def _corpus(path: Path, text, n=40) -> Path:
    path.mkdir(parents=True)
    (path / "a.jsonl").write_text("".join(json.dumps({"source": f"pkg:doc/{i}", "text": text}) + "\n"
                                          for i in range(n)))
    return path


def test_train_on_a_corpus_of_null_texts_is_refused(env, capsys, tmp_path):
    """It trained on the strings "None" and reported held-out perplexity 1.0 from 0 scored tokens."""
    corpus = _corpus(tmp_path / "nulls", None)
    _check(["train", "--model", "tiny", "--data-dir", corpus, "--out", tmp_path / "run", "--steps", "2",
            "--no-progress"], "a.jsonl:1: 'text' must be a string, got null", capsys)


def test_train_with_nothing_to_score_is_refused(env, capsys, tmp_path):
    """Empty texts: the held-out split is a few end-of-document tokens, no whole sequence to score."""
    corpus = _corpus(tmp_path / "empty", "")
    _check(["train", "--model", "tiny", "--data-dir", corpus, "--out", tmp_path / "run", "--steps", "2",
            "--seq-len", "32", "--vocab-size", "300", "--no-progress"], "fewer than one 32-token sequence", capsys)
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize("content, culprit", [("", "the file is empty"), (" \n\n", "the file is empty"),
                                              ("hello world\n", "tokens, fewer than one chunk of 256")])
def test_empty_or_short_text_file_is_named(capsys, tmp_path, content, culprit):
    """'the text has 0 tokens' did not say which text."""
    f = tmp_path / "notes.txt"
    f.write_text(content)
    line = _check(["trace", "record", "--model", "granular", "--task", "text-file", "--file", f, "--tokens", "64",
                   "--out", tmp_path / "t.trace"], culprit, capsys)
    assert f"--file {f}" in line


@pytest.mark.parametrize("value", ['"0.12"', "true", "1.5", "-0.1"])
def test_report_row_with_a_miss_rate_that_is_not_a_rate(capsys, tmp_path, value):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"miss_rate": 0.1, "quality": 10.0}\n{"miss_rate": ' + value + ', "quality": 11.0}\n')
    _check(["report", rows, "--out-dir", tmp_path / "figs"], f"rows.jsonl: row 2: miss_rate must be a number in [0, 1], "
           f"got {value}", capsys)
    assert not (tmp_path / "figs").exists()


# -- full disks and closed pipes: the output is named, a result is shown before its file fails, rows are whole --


def test_simulate_and_eval_show_their_result_before_a_full_disk_fails_the_file(env, capsys):
    """``--out /dev/full`` said '[Errno 28] No space left on device' (which output?) and lost the result."""
    line = _check(["simulate", env["trace"], "--out", "/dev/full"], "/dev/full: No space left on device", capsys)
    capsys.readouterr()
    assert main(["simulate", env["trace"], "--out", "/dev/full"]) == 2
    assert "miss rate" in capsys.readouterr().out  # the table came first
    code = main(["eval", "--model", "granular", "--task", "wikitext", "--limit", "1", "--data-dir", env["data"],
                 "--no-progress", "--out", "/dev/full"])
    cap = capsys.readouterr()
    assert code == 2 and "ppl" in cap.out and "error: /dev/full: No space left on device" in cap.err, cap
    assert line.count("error:") == 1


def test_a_full_disk_never_leaves_a_torn_row_and_sweep_counts_what_it_wrote(env, capsys, tmp_path, monkeypatch):
    """The third row's write is cut short (a full disk): the file keeps two whole rows, the torn part is cut off,
    and the error says 2 runs were appended (it said '3 runs appended' over 2 rows and a torn third)."""
    import expertcache.results as results

    real_write, calls = os.write, []

    def full_after_two(fd, data):
        calls.append(len(data))
        if len(calls) == 3:
            return real_write(fd, data[: len(data) // 2])  # a short write: the disk filled up mid-row
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", full_after_two)
    out = tmp_path / "rows.jsonl"
    line = _check(["sweep", "--trace", env["trace"], "--policies", "original,cache-prior", "--grid", "3",
                   "--capacity", "0.5", "--eviction", "lru", "--out", out, "--no-progress"], str(out), capsys)
    assert "2 of " in line and "runs appended before" in line and "No space" in line, line
    text = out.read_text()
    assert text.endswith("\n") and [json.loads(x)["sweep_key"] for x in text.splitlines()]  # whole rows only
    assert len(text.splitlines()) == 2


def test_sweep_lock_is_keyed_on_the_real_path(tmp_path):
    """A symlink to the output and the output itself are one file: one lock (two locks let two sweeps append)."""
    from expertcache.eval.sweep import SweepLockedError, sweep_lock

    (tmp_path / "real").mkdir()
    out = tmp_path / "real" / "rows.jsonl"
    out.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    fd = os.open(str(out) + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another sweep holds the real file
        with pytest.raises(SweepLockedError, match="another sweep"):
            with sweep_lock(link):
                pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_report_out_dir_on_a_full_disk_names_the_file(env, capsys, tmp_path, monkeypatch):
    import expertcache.results as results

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.os, "fsync", no_space)
    rows = Path(__file__).resolve().parents[1] / "docs" / "results" / "open-loop-granular.jsonl"
    out = tmp_path / "figs"
    _check(["report", rows, "--out-dir", out], f"{out / 'pareto.md'}: No space left on device", capsys)
    assert not list(out.glob("*.md"))


@pytest.mark.parametrize("how", ["closed pipe", "/dev/full"])
def test_stdout_closed_early_or_full_is_one_line(env, how):
    """stdout closed by the reader (``| head -0``) or on a full disk: '[Errno 32]' / '[Errno 28]' and, at exit,
    'Exception ignored ... BrokenPipeError'; now one line naming stdout, exit 2."""
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    envv = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "expertcache.cli.main", "simulate", env["trace"], "--belady"]
    if how == "closed pipe":
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=envv)
        p.stdout.close()  # the reader goes away before any output
        err = p.stderr.read().decode()
        code = p.wait(timeout=120)
    else:
        with open("/dev/full", "w") as full:
            proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, env=envv, timeout=120)
        err, code = proc.stderr.decode(), proc.returncode
    assert code == 2 and "Traceback" not in err and "Exception ignored" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "error: stdout:" in lines[0], err


@pytest.mark.parametrize("argv,culprit", [
    (["serve", "--port", "0", "--max-request-bytes", "0"], "--max-request-bytes"),
    (["serve", "--port", "0", "--max-prompt-tokens", "-1"], "--max-prompt-tokens"),
    (["serve", "--port", "0", "--max-prompt-tokens", "100000"], "--max-prompt-tokens 100000"),
    (["serve", "--port", "0", "--api-key", ""], "--api-key"),
    (["serve", "--port", "0", "--device", "cuda:7"], "--device"),
    (["generate", "--device", "bogus", "hi"], "--device"),
    (["bench", "--device", "cuda", "--tokens", "2"], "--device"),
    (["trace", "record", "--device", "cuda:3", "--out", "/tmp/never-written.trace"], "--device"),
    (["serve", "--port", "0", "--prefill-delay", "-1"], "--prefill-delay"),
    (["serve", "--port", "0", "--prefill-delay", "nan"], "--prefill-delay"),
    (["serve", "--port", "0", "--allowed-host", "http://box.lan"], "--allowed-host"),
    (["serve", "--port", "0", "--allowed-host", "a b"], "--allowed-host"),
    (["generate", "--readers", "-1", "hi"], "--readers"),
    (["melinoe", "finetune", "--preset", "bogus", "--out", "x"], "--preset"),
])
def test_flags_added_this_round_name_a_bad_value(argv, culprit, capsys):
    """The serve limits and key, --device and MELINOE's --preset: one line naming the flag, exit 2, before a model
    loads (a CUDA device is refused on a machine without one; tests/test_gpu.py covers the others)."""
    import torch

    if "cuda" in " ".join(argv) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the device may exist")
    _check(argv, culprit, capsys)


def test_embedding_variable_is_refused_before_the_work(env, capsys, monkeypatch):
    """$EXPERTCACHE_EMBEDDING (the token embedding read on demand or held: offload/diskembed.py) must be disk or
    ram: one line naming it, exit 2."""
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "bogus")
    line = _check(["generate", "--quant", "int4", "--max-new-tokens", "2", "hello"], "EXPERTCACHE_EMBEDDING", capsys)
    assert "bogus" in line and "disk" in line and "ram" in line
