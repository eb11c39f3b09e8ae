"""The pure helpers and flag checks of benchmarks/bench_llama_quality.py (no llama.cpp, no trained model needed)."""

import importlib.util
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("bench_llama_quality", BENCH / "bench_llama_quality.py")
blq = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(blq)


def test_bits_per_weight_of_ggml_types_by_hand():
    # Q4_K: a 256-weight super-block = 2 fp16 (d, dmin) + 12 bytes of 6-bit scales/mins + 128 bytes of codes = 144;
    # Q6_K: 128 low nibbles + 64 high bits + 16 int8 scales + fp16 d = 210; Q4_0: fp16 d + 16 bytes per 32 = 18;
    # Q8_0: fp16 d + 32 bytes = 34.
    assert blq.tensor_bytes("Q4_K", 512) == 2 * (2 * 2 + 12 + 128)
    assert blq.tensor_bytes("Q6_K", 256) == 128 + 64 + 16 + 2
    assert blq.tensor_bytes("Q4_0", 64) == 2 * (2 + 16) and blq.tensor_bytes("Q8_0", 32) == 2 + 32
    tensors = [("Q4_K", 512), ("Q6_K", 256), ("F32", 256), ("Q8_0", 64)]
    total = 2 * 144 + 210 + 4 * 256 + 2 * 34  # 1590 bytes over 1088 weights
    assert blq.bits_per_weight(tensors) == pytest.approx(8 * total / 1088)
    assert blq.bits_per_weight([("Q4_K", 256)]) == 4.5 and blq.bits_per_weight([("Q4_0", 32)]) == 4.5
    assert blq.bits_per_weight([("Q8_0", 32)]) == 8.5 and blq.bits_per_weight([("F16", 7)]) == 16
    assert blq.bits_per_weight(tensors, params=2 * 1088) == pytest.approx(4 * total / 1088)  # another count
    with pytest.raises(ValueError, match="Q4_K blocks of 256"):
        blq.tensor_bytes("Q4_K", 144)  # granular's rows: what K-quants cannot take
    with pytest.raises(ValueError, match="unknown ggml type"):
        blq.tensor_bytes("Q9_X", 256)


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_compare_against_an_independent_formula():
    torch = pytest.importorskip("torch")
    rng = random.Random(0)
    C, S, V = 2, 5, 7
    a = [[[rng.gauss(0, 2) for _ in range(V)] for _ in range(S)] for _ in range(C)]
    b = [[[x + rng.gauss(0, 0.5) for x in row] for row in chunk] for chunk in a]
    ids = [[rng.randrange(V) for _ in range(S)] for _ in range(C)]
    got = blq.compare(torch.log_softmax(torch.tensor(a, dtype=torch.float64), -1),
                      torch.log_softmax(torch.tensor(b, dtype=torch.float64), -1), torch.tensor(ids))
    kls, nll_a, nll_b, agree = [], 0.0, 0.0, 0
    for c in range(C):
        for s in range(S - 1):  # positions that predict a token of the chunk
            p, q = _softmax(a[c][s]), _softmax(b[c][s])
            kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
            nll_a -= math.log(p[ids[c][s + 1]])
            nll_b -= math.log(q[ids[c][s + 1]])
            agree += p.index(max(p)) == q.index(max(q))
    n = C * (S - 1)
    kls.sort()
    pos = 0.99 * (n - 1)  # linear interpolation between closest ranks
    p99 = kls[int(pos)] + (pos - int(pos)) * (kls[min(int(pos) + 1, n - 1)] - kls[int(pos)])
    assert got["positions"] == n
    assert got["kl_mean"] == pytest.approx(sum(kls) / n, rel=1e-9)
    assert got["kl_p99"] == pytest.approx(p99, rel=1e-9) and got["kl_max"] == pytest.approx(kls[-1], rel=1e-9)
    assert got["ppl_ref"] == pytest.approx(math.exp(nll_a / n), rel=1e-9)
    assert got["ppl"] == pytest.approx(math.exp(nll_b / n), rel=1e-9)
    assert got["ppl_change"] == pytest.approx(math.exp(nll_b / n) / math.exp(nll_a / n) - 1, rel=1e-9)
    assert got["top1_agree"] == pytest.approx(agree / n)
    same = blq.compare(torch.tensor(a), torch.tensor(a), torch.tensor(ids))  # a system against itself
    assert same["kl_mean"] == 0 and same["ppl_change"] == 0 and same["top1_agree"] == 1


@pytest.mark.parametrize("argv, culprit", [
    (["--model", "{tmp}/nothing"], "--model"),
    (["--model", "{tmp}", "--chunks", "0"], "--chunks"),
    (["--model", "{tmp}", "--threads", "0"], "--threads"),
    (["--model", "{tmp}", "--systems", "llama-Q5_X"], "--systems"),
])
def test_flags_are_checked_before_the_work_in_one_line(argv, culprit, tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = [x.replace("{tmp}", str(tmp_path)) for x in argv]
    r = subprocess.run([sys.executable, str(BENCH / "bench_llama_quality.py"), *argv, "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and culprit in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not out.exists()


def test_a_llama_system_without_the_converter_is_refused(tmp_path):
    """Skipped unless llama-cpp-python is here: a llama.cpp system named without the converter in its
    vendor folder is refused in one line before any work."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    r = subprocess.run([sys.executable, str(BENCH / "bench_llama_quality.py"), "--model", str(model), "--systems",
                        "llama-Q4_K_M", "--vendor", str(tmp_path), "--out", str(tmp_path / "rows.jsonl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--vendor" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_simulated_recipes_count_bits_as_stored_and_pick_the_last_matching_entry():
    # int4 G=64: 4 bits a weight + a bf16 scale and a bf16 zero per 64; int8: 8 bits + a bf16 scale per row
    assert blq.stored_bits("int4/64/lsq", 2, 128) == 2 * (128 * 4 + 2 * (16 + 16))
    assert blq.stored_bits("int8", 3, 256) == 3 * (256 * 8 + 16) and blq.stored_bits("bf16", 3, 5) == 240
    recipe = blq.parse_recipe("down=int4/64/lsq attn=int8 down@2,3=int8")
    assert blq.precision_of(recipe, *blq.param_part("model.layers.3.mlp.experts.down_proj")) == "int8"
    assert blq.precision_of(recipe, *blq.param_part("model.layers.1.mlp.experts.down_proj")) == "int4/64/lsq"
    assert blq.precision_of(recipe, *blq.param_part("model.layers.0.self_attn.q_proj.weight")) == "int8"
    assert blq.param_part("model.layers.0.self_attn.v_proj.weight") == ("attn_v", 0)
    assert blq.precision_of(recipe, *blq.param_part("model.layers.0.mlp.gate.weight")) == "bf16"  # router
    assert blq.param_part("lm_head.weight") == ("head", None)
    with pytest.raises(ValueError, match="int4/64"):
        blq.parse_recipe("down=int4/64")
    for text in blq.SIM_RECIPES.values():
        blq.parse_recipe(text)


@pytest.mark.parametrize("case", ["inside-model", "a-file", "users-gguf"])
def test_the_gguf_folder_never_takes_an_input_or_a_users_file(case, tmp_path):
    """--gguf-dir (where llama.cpp's files are made) is refused in one line before the work when it lies in the
    input model folder, is a file, or holds a file of the name this run would make again that it did not write."""
    import os

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    gdir = {"inside-model": model / "gguf", "a-file": tmp_path / "f", "users-gguf": tmp_path / "g"}[case]
    if case == "a-file":
        gdir.write_text("mine")
    if case == "users-gguf":
        gdir.mkdir()
        mine = gdir / "m-Q4_K_M.gguf"
        mine.write_text("a user's own file")
        os.utime(mine, (1, 1))  # older than the checkpoint: this run would make it again
    r = subprocess.run([sys.executable, str(BENCH / "bench_llama_quality.py"), "--model", str(model), "--systems",
                        "llama-Q4_K_M", "--gguf-dir", str(gdir), "--vendor", str(tmp_path),
                        "--out", str(tmp_path / "rows.jsonl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and "--gguf-dir" in last, r.stderr[-2000:]
    if case == "users-gguf":
        assert (gdir / "m-Q4_K_M.gguf").read_text() == "a user's own file"
