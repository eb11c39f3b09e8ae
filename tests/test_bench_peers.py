"""The small helpers of benchmarks/bench_peers.py (no llama.cpp, no cgroups, no root needed)."""

import importlib.util
import os
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_peers", Path(__file__).parents[1] / "benchmarks" / "bench_peers.py")
bp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bp)

GiB = 2**30


def test_readahead_restores_the_previous_value_also_on_error(tmp_path):
    f = tmp_path / "read_ahead_kb"
    f.write_text("8192\n")
    with bp.readahead(128, f) as kb:
        assert kb == 128 and f.read_text().strip() == "128"
    assert f.read_text().strip() == "8192"
    with pytest.raises(RuntimeError):
        with bp.readahead(256, f):
            assert f.read_text().strip() == "256"
            raise RuntimeError("child crashed")
    assert f.read_text().strip() == "8192"
    with bp.readahead(None, f) as kb:  # leave alone
        assert kb == 8192
    assert f.read_text().strip() == "8192"


def test_accelerate_split_keeps_what_fits_after_non_expert_weights_and_one_transient_layer():
    layer = 805 * 10**6
    nonexp = 953 * 10**6
    # 25 % of the 16-layer checkpoint: 3.46 GB - 0.5 GiB - 0.95 GB - one transient layer -> 1 layer in RAM
    assert bp.accelerate_split(3_460_000_000, nonexp, layer, 16) == 1
    assert bp.accelerate_split(6_920_000_000, nonexp, layer, 16) == 5
    # never negative, never more than the model has
    assert bp.accelerate_split(GiB, nonexp, layer, 16) == 0
    assert bp.accelerate_split(100 * GiB, nonexp, layer, 16) == 16


def test_summarize_medians_failures_and_llama_at_its_better_readahead():
    def row(system, tok_s, ra=8192, ok=True, budget=0.5):
        r = dict(system=system, budget=budget, readahead_kb=ra, ok=ok)
        if ok:
            r.update(tok_s=tok_s, bytes_per_token=tok_s * 2**20)
        else:
            r["error"] = "killed by SIGKILL (cgroup OOM)"
        return r

    rows = [row("llama", 0.3), row("llama", 0.2), row("llama", 1.2, ra=128), row("llama", 1.4, ra=128),
            row("ec-cp", 4.0), row("ec-cp", 3.0), row("ec-lru", 2.0), row("accelerate", 0, ok=False),
            row("ec-cp", 9.0, budget=0.25), row("llama", 1.0, budget=0.25)]
    s = {(x["budget"], x["system"], x["readahead_kb"]): x for x in bp.summarize(rows)}
    assert s[(0.5, "llama", 8192)]["tok_s"] == pytest.approx(0.25)
    assert s[(0.5, "llama", 128)]["tok_s"] == pytest.approx(1.3)
    assert s[(0.5, "llama-best", 128)]["tok_s"] == pytest.approx(1.3)  # the better readahead is chosen
    assert s[(0.5, "ec-cp", 8192)]["tok_s"] == pytest.approx(3.5)
    acc = s[(0.5, "accelerate", 8192)]
    assert acc["failed"] == 1 and "tok_s" not in acc and "OOM" in acc["errors"][0]
    r = bp.ratios(bp.summarize(rows))
    assert r[(0.5, "ec-cp")] == pytest.approx(3.5 / 1.3)
    assert r[(0.5, "ec-lru")] == pytest.approx(2.0 / 1.3)
    assert r[(0.25, "ec-cp")] == pytest.approx(9.0)
    assert (0.25, "ec-lru") not in r
    for i, x in enumerate(rows):
        x["round"] = i % 2
    rr = bp.round_ratios(rows)  # round 0: llama 0.3, 1.2 -> 1.2; round 1: 0.2, 1.4 -> 1.4
    assert rr[(0.5, "ec-cp")] == pytest.approx([4.0 / 1.2, 3.0 / 1.4])
    assert rr[(0.5, "ec-lru")] == pytest.approx([2.0 / 1.2])


def test_summary_keeps_each_checkpoints_rows_apart(tmp_path, capsys):
    """Budgets are fractions of each checkpoint's own size: 0.5 of a 4-layer and of a 16-layer checkpoint are
    different limits, so their rows never share a median or a same-round ratio."""
    import json

    def row(model, system, tok_s, **kw):
        r = dict(system=system, budget=0.5, budget_label="0.5 of bf16", readahead_kb=128, round=0, ok=True,
                 tok_s=tok_s, bytes_per_token=2**20, **kw)
        return r if model is None else dict(r, model=model)

    rows = [row("L4", "ec-cp", 8.0), row("L4", "llama-q4", 2.0), row("L16", "ec-cp", 1.0),
            row("L16", "llama-q4", 4.0), row(None, "ec-cp", 100.0)]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bp.main(["summary", str(f)])
    out = capsys.readouterr().out
    tables = {t.split("\n", 1)[0].strip(): t for t in out.split("### ")[1:]}
    assert set(tables) == {"L4", "L16", "checkpoint not recorded"}
    assert "| ec-cp | 128 | 8.00 |" in tables["L4"] and "4.00×" in tables["L4"]  # 8 ÷ 2, not mixed with L16
    assert "| ec-cp | 128 | 1.00 |" in tables["L16"] and "0.25×" in tables["L16"]
    assert "100.00" in tables["checkpoint not recorded"] and "100.00" not in tables["L4"] + tables["L16"]


def test_proc_io_and_drop_page_cache(tmp_path):
    io = bp.proc_io()
    assert io["read_bytes"] >= 0 and "rchar" in io
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.dat").write_bytes(b"y" * 500)
    assert bp.drop_page_cache([tmp_path, None, tmp_path / "missing"]) == 10500
    assert bp.checkpoint_bytes(tmp_path) == 10000
    os.remove(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        bp.checkpoint_bytes(tmp_path)


def test_budget_limit_fractions_of_the_checkpoint_and_of_the_q4_file():
    ckpt, q4 = 13_840_000_000, 4_210_000_000
    assert bp.budget_limit("0.5", ckpt) == (0.5, 6_920_000_000, "0.5 of bf16 (6.92 GB)")
    assert bp.budget_limit(0.25, ckpt)[1] == 3_460_000_000
    frac, limit, label = bp.budget_limit("q0.25", ckpt, q4)
    assert limit == 1_052_500_000 and frac == pytest.approx(limit / ckpt) and "Q4_K_M (1.05 GB)" in label
    assert bp.budget_limit("Q0.5", ckpt, q4)[1] == 2_105_000_000
    for bad in ("half", "q", "0", "-0.5", "5"):
        with pytest.raises(ValueError, match="budget"):
            bp.budget_limit(bad, ckpt, q4)
    with pytest.raises(ValueError, match="--gguf-q4"):
        bp.budget_limit("q0.5", ckpt, None)


def test_round_order_puts_every_system_before_and_after_every_other():
    plan = ["a", "b", "c"]
    orders = [bp.round_order(plan, r) for r in range(6)]
    assert all(sorted(o) == plan for o in orders)
    for x in plan:
        for y in plan:
            if x != y:
                assert any(o.index(x) < o.index(y) for o in orders) and any(o.index(x) > o.index(y) for o in orders)
    assert [bp.round_order(["a", "b"], r) for r in range(2)] == [["a", "b"], ["a", "b"][::-1]]


def test_no_repack_turns_off_extra_buffer_types_in_every_model_llama_cpp_python_loads(monkeypatch):
    """llama-cpp-python's Llama starts from llama_model_default_params() of its low-level module; the patch
    makes that return use_extra_bufts=False (llama.cpp's --no-repack), once, keeping every other default."""
    import sys
    import types

    class Params:
        def __init__(self):
            self.use_extra_bufts, self.use_mmap = True, True

    low = types.SimpleNamespace(llama_model_default_params=Params)
    pkg = types.ModuleType("llama_cpp")
    llama_py = types.ModuleType("llama_cpp.llama")
    llama_py.llama_cpp = low
    pkg.llama = llama_py
    monkeypatch.setitem(sys.modules, "llama_cpp", pkg)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", llama_py)
    bp.no_repack(pkg)
    bp.no_repack(pkg)  # idempotent
    p = low.llama_model_default_params()
    assert p.use_extra_bufts is False and p.use_mmap is True
    assert low.llama_model_default_params._no_repack
