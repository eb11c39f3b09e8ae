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
    assert "| ec-cp |  | 128 | 8.00 |" in tables["L4"] and "4.00×" in tables["L4"]  # 8 ÷ 2, not mixed with L16
    assert "| ec-cp |  | 128 | 1.00 |" in tables["L16"] and "0.25×" in tables["L16"]
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


# -- both ISAs, llama.cpp's best path, time to the first token (issue 45) -----------------------------------

AVX512_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
               "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
AVX2_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
             "OPENMP = 1 | REPACK = 1 | ")


def test_isa_env_caps_all_three_kernel_libraries_or_none():
    env = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512"}
    capped = bp.isa_env("avx2", env)
    assert capped == {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                      "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "NUMBA_CPU_NAME": "haswell",
                      "NUMBA_CPU_FEATURES": "+avx2,+fma"}
    assert bp.isa_env("native", env) == {"PATH": "/bin"}  # a cap inherited from the caller is not kept
    assert env["ATEN_CPU_CAPABILITY"] == "avx512"  # the caller's dict is not changed
    with pytest.raises(ValueError, match="--isa"):
        bp.isa_env("avx512x", env)


def test_parse_cpuinfo_reads_the_model_and_the_kernel_choosing_flags():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n"
            "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx_vnni\n\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    got = bp.parse_cpuinfo(text)
    assert got["cpu"] == "AMD EPYC 9B14"
    assert set(got["cpu_flags"]) == {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni"}
    intel = bp.parse_cpuinfo("model name : Xeon\nflags : avx2 amx_tile amx_int8 amx_bf16 avx512f\n")
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx512f"} <= set(intel["cpu_flags"])
    assert bp.parse_cpuinfo("") == {"cpu": "?", "cpu_flags": []}


def test_llama_build_isa_from_its_system_info():
    feats = bp.llama_features(AVX512_INFO)
    assert feats["AVX512_VNNI"] == 1 and feats["SSE3"] == 1 and feats["REPACK"] == 1
    assert bp.llama_build_isa(AVX512_INFO) == "avx512"
    assert bp.llama_build_isa(AVX2_INFO) == "avx2"
    assert bp.llama_build_isa(AVX2_INFO.replace("AVX2 = 1", "AVX2 = 0")) == "none"
    assert bp.llama_build_isa(AVX2_INFO + "AVX512 = 0 | ") == "avx2"  # listed but off
    # an AVX-512 build cannot stand for the AVX2 one; native takes either
    assert "AVX-512" in bp.check_llama_build("avx2", AVX512_INFO, "B") and "B" in bp.check_llama_build("avx2", AVX512_INFO, "B")
    assert bp.check_llama_build("avx2", AVX2_INFO, "B") is None
    assert bp.check_llama_build("native", AVX512_INFO, "B") is None


def test_run_plan_runs_every_llama_path_and_prime_systems_one_per_quantised_configuration():
    plan = bp.run_plan(["llama-q4", "ec-q4p-cp", "ec-q4p-lru", "ec-cp"], ["repack", "no-repack"], 128, True)
    assert plan == [("llama-q4", 128, "repack"), ("llama-q4", 128, "no-repack"), ("ec-q4p-cp", None, None),
                    ("ec-q4p-lru", None, None), ("ec-cp", None, None)]
    assert len(bp.run_plan(["llama-q4"], ["repack", "no-repack"], 128, False)) == 4  # × default readahead
    # the two q4-preset systems share one sidecar; bf16 experts need none; int4 + dense int4 is another one
    assert bp.prime_systems(["llama-q4", "ec-q4p-cp", "ec-q4p-lru", "ec-cp", "ec-q4d-cp"]) == ["ec-q4p-cp", "ec-q4d-cp"]
    assert bp.EC_CHILDREN["ec-q4p-cp"] == ("cache-prior", "q4", None)


def _q4row(system, tok_s, rnd, path=None, ttft=None, budget=0.5, kind="peers"):
    return dict(kind=kind, system=system, budget=budget, readahead_kb=128, llama_path=path, round=rnd, ok=True,
                tok_s=tok_s, bytes_per_token=0.0, ttft_s=ttft)


def test_llama_q4_best_is_the_faster_path_and_round_ratios_use_that_paths_run():
    rows = [_q4row("llama-q4", 5.0, 0, "repack", 4.0), _q4row("llama-q4", 4.0, 0, "no-repack", 3.0),
            _q4row("llama-q4", 6.0, 1, "repack", 5.0), _q4row("llama-q4", 7.0, 1, "no-repack", 2.0),
            _q4row("llama-q4", 5.4, 2, "repack", 4.0), _q4row("llama-q4", 6.0, 2, "no-repack", 3.0),
            _q4row("ec-q4p-cp", 8.0, 0, ttft=8.0), _q4row("ec-q4p-cp", 7.0, 1, ttft=6.0),
            _q4row("ec-q4p-cp", 9.0, 2, ttft=9.0),
            _q4row("ec-q4p-cp", 100.0, -1, ttft=600.0, kind="peers-prime")]  # the prime run: no median, no ratio
    s = {(x["system"], x["llama_path"]): x for x in bp.summarize(rows)}
    assert s[("llama-q4", "repack")]["tok_s"] == pytest.approx(5.4)  # median of 5.0, 6.0, 5.4
    assert s[("llama-q4", "no-repack")]["tok_s"] == pytest.approx(6.0)  # median of 4.0, 7.0, 6.0
    best = s[("llama-q4-best", "no-repack")]
    assert best["tok_s"] == pytest.approx(6.0) and best["ttft_s"] == pytest.approx(3.0)
    assert s[("ec-q4p-cp", None)]["tok_s"] == pytest.approx(8.0) and s[("ec-q4p-cp", None)]["runs"] == 3
    assert bp.ratios(bp.summarize(rows), "llama-q4-best")[(0.5, "ec-q4p-cp")] == pytest.approx(8.0 / 6.0)
    fixed = bp.round_ratios(rows, "llama-q4", {0.5: (128, "no-repack")})
    assert fixed[(0.5, "ec-q4p-cp")] == pytest.approx([8.0 / 4.0, 7.0 / 7.0, 9.0 / 6.0])
    faster = bp.round_ratios(rows, "llama-q4")  # without a best path: the faster run of each round
    assert faster[(0.5, "ec-q4p-cp")] == pytest.approx([8.0 / 5.0, 7.0 / 7.0, 9.0 / 6.0])
    ttft = bp.round_ratios(rows, "llama-q4", {0.5: (128, "no-repack")}, key="ttft_s")
    assert ttft[(0.5, "ec-q4p-cp")] == pytest.approx([8.0 / 3.0, 6.0 / 2.0, 9.0 / 3.0])


def test_summary_keeps_each_isa_and_thread_count_apart(tmp_path, capsys):
    import json

    rows = [dict(_q4row("llama-q4", 4.0, 0, "repack"), model="L8", isa="native", cpu="EPYC", cpu_flags=["avx2"]),
            dict(_q4row("ec-q4p-cp", 8.0, 0), model="L8", isa="native"),
            dict(_q4row("llama-q4", 2.0, 0, "repack"), model="L8", isa="avx2"),
            dict(_q4row("ec-q4p-cp", 1.0, 0), model="L8", isa="avx2"),
            dict(_q4row("ec-q4p-cp", 3.0, 0), model="L8", isa="avx2", threads=2)]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bp.main(["summary", str(f)])
    tables = {t.split("\n", 1)[0].strip(): t for t in capsys.readouterr().out.split("### ")[1:]}
    assert set(tables) == {"L8", "L8 · --isa avx2", "L8 · --isa avx2 · 2 threads"}
    assert "2.00×" in tables["L8"] and "CPU: EPYC [avx2]" in tables["L8"]  # 8 ÷ 4
    assert "0.50×" in tables["L8 · --isa avx2"]  # 1 ÷ 2, not mixed with the native or 2-thread rows
    assert "3.00" in tables["L8 · --isa avx2 · 2 threads"] and "3.00" not in tables["L8 · --isa avx2"]


def test_check_args_refuses_bad_isa_and_llama_builds_before_the_work(tmp_path):
    import argparse

    model = tmp_path / "m"
    model.mkdir()
    q4 = tmp_path / "q4.gguf"
    q4.write_bytes(b"x")
    build = tmp_path / "build"
    (build / "llama_cpp").mkdir(parents=True)

    def args(**kw):
        base = dict(cmd="run", threads=1, rounds=3, llama_path=str(build), model=str(model), gguf=None, gguf_q4=str(q4),
                    q4_bytes=None, budgets=["0.5", "q0.5"], isa="avx2", systems=["llama-q4", "ec-q4p-cp"])
        return argparse.Namespace(**{**base, **kw})

    probe = {str(build): AVX2_INFO}
    ok = lambda path: probe[path]  # noqa: E731
    assert bp.check_args(args(), ok) is None
    assert "AVX-512" in bp.check_args(args(), lambda path: AVX512_INFO)
    assert "--llama-path" in bp.check_args(args(llama_path=None), ok)
    assert "--llama-path" in bp.check_args(args(llama_path=str(tmp_path)), ok)  # no llama_cpp package there
    assert "--threads" in bp.check_args(args(threads=0), ok)
    assert "--gguf-q4" in bp.check_args(args(gguf_q4=str(tmp_path / "none.gguf")), ok)
    assert "--budgets" in bp.check_args(args(budgets=["half"]), ok)

    def broken(path):
        raise RuntimeError("ImportError: libggml.so")

    assert "does not import" in bp.check_args(args(), broken)
    # expertcache alone under --isa avx2 needs no llama.cpp build
    assert bp.check_args(args(llama_path=None, systems=["ec-q4p-cp"]), broken) is None


def test_run_refuses_an_avx2_run_without_a_llama_build_in_one_line(tmp_path):
    import subprocess
    import sys

    q4 = tmp_path / "q4.gguf"
    q4.write_bytes(b"x")
    r = subprocess.run([sys.executable, str(Path(bp.__file__)), "run", "--model", str(tmp_path), "--gguf-q4", str(q4),
                        "--systems", "llama-q4", "ec-q4p-cp", "--isa", "avx2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--llama-path" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_llama_q4_best_is_the_path_that_ran_where_the_other_failed_every_time():
    rows = [_q4row("llama-q4", 5.0, 0, "no-repack"), _q4row("llama-q4", 6.0, 1, "no-repack"),
            dict(_q4row("llama-q4", 0, 0, "repack"), ok=False, error="exit -11"),
            dict(_q4row("llama-q4", 0, 1, "repack"), ok=False, error="exit -4"),
            _q4row("ec-q4p-cp", 11.0, 0), _q4row("ec-q4p-cp", 6.0, 1)]
    s = {(x["system"], x["llama_path"]): x for x in bp.summarize(rows)}
    assert s[("llama-q4-best", "no-repack")]["tok_s"] == pytest.approx(5.5)
    assert s[("llama-q4", "repack")]["failed"] == 2
    assert bp.ratios(bp.summarize(rows), "llama-q4-best")[(0.5, "ec-q4p-cp")] == pytest.approx(8.5 / 5.5)
