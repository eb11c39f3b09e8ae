"""The memory plan of the whole process (offload/budget.py): the container's limit (cgroup v1 / v2, read from a
fake tree), ``--memory auto``, refusals before anything large is allocated, and the plan's process peak
against the measured peak RSS of real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expertcache.cli.main import main
from expertcache.models.tiny import save_tiny
from expertcache.offload import BudgetError, OffloadConfig, OffloadedModel
from expertcache.offload.budget import (AUTO, RUNTIME_OVERHEAD, cgroup_memory_limit, container_limit, parse_bytes,
                                        plan_memory, process_rss)

GiB, MiB = 2**30, 2**20
V1_NO_LIMIT = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def fake_tree(root: Path, proc_cgroup: str, files: dict[str, str], meminfo: str | None = None) -> Path:
    """A fake root: ``proc/self/cgroup`` and limit files at paths relative to ``root``."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    if meminfo is not None:
        (root / "proc/meminfo").write_text(meminfo)
    return root


# -- the container's limit -------------------------------------------------------------------------


def test_cgroup_v1_limit_is_the_smallest_along_the_path(tmp_path):
    m = "sys/fs/cgroup/memory"
    files = {f"{m}/memory.limit_in_bytes": V1_NO_LIMIT, f"{m}/job/memory.limit_in_bytes": str(8 * GiB),
             f"{m}/job/run/memory.limit_in_bytes": str(3 * GiB),
             "sys/fs/cgroup/cpu/job/run/cpu.shares": "1024"}  # other controllers are not limits
    root = fake_tree(tmp_path, "12:memory:/job/run\n11:cpu,cpuacct:/job/run\n1:name=systemd:/job\n", files)
    assert cgroup_memory_limit(root) == 3 * GiB
    (root / m / "job/memory.limit_in_bytes").write_text(f"{2 * GiB}\n")  # a tighter ancestor wins
    assert cgroup_memory_limit(root) == 2 * GiB


def test_cgroup_v2_memory_max(tmp_path):
    files = {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/user.slice/memory.max": "max",
             "sys/fs/cgroup/user.slice/job/memory.max": str(1536 * MiB)}
    root = fake_tree(tmp_path, "0::/user.slice/job\n", files)
    assert cgroup_memory_limit(root) == 1536 * MiB
    (root / "sys/fs/cgroup/user.slice/job/memory.max").write_text("max\n")
    assert cgroup_memory_limit(root) is None  # 'max' everywhere: no limit


def test_cgroup_without_a_limit_or_a_file(tmp_path):
    assert cgroup_memory_limit(tmp_path / "nothing") is None  # no /proc/self/cgroup
    root = fake_tree(tmp_path / "a", "12:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT})
    assert cgroup_memory_limit(root) is None
    root = fake_tree(tmp_path / "b", "3:cpu:/x\n", {})  # no memory controller
    assert cgroup_memory_limit(root) is None


def test_container_sees_its_own_cgroup_at_the_mount(tmp_path):
    """Without a cgroup namespace the path is the host's, and the container mounts its own cgroup at the root."""
    root = fake_tree(tmp_path, "9:memory:/docker/0123abcd\n",
                     {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GiB)})
    assert cgroup_memory_limit(root) == 4 * GiB


@pytest.mark.parametrize("text", ["lots", "-5", "1.5e9", ""])
def test_unreadable_cgroup_limit_names_the_file(tmp_path, text):
    root = fake_tree(tmp_path, "0::/j\n", {"sys/fs/cgroup/j/memory.max": text})
    with pytest.raises(ValueError, match=r"j/memory.max"):
        cgroup_memory_limit(root)


def test_container_limit_falls_back_to_mem_available(tmp_path):
    root = fake_tree(tmp_path, "3:cpu:/x\n", {}, meminfo="MemTotal: 24000000 kB\nMemAvailable: 1000000 kB\n")
    n, source = container_limit(root)
    assert "MemAvailable" in source
    assert 1_024_000_000 <= n <= 1_024_000_000 + process_rss() + 64 * MiB  # plus what this process holds
    root = fake_tree(tmp_path / "c", "0::/j\n", {"sys/fs/cgroup/j/memory.max": str(GiB)})
    assert container_limit(root) == (GiB, "memory cgroup limit")


# -- the plan of the process ---------------------------------------------------------------------

SIZES = dict(non_expert_bytes=300 * MiB, kv_bytes=8 * MiB, expert_bytes=3 * MiB, slot_bytes=3 * MiB + 4096,
             num_layers=16, num_experts=64, top_k=8, extra_slots=1, io_bytes=0)
PROCESS = dict(baseline_bytes=450 * MiB, load_bytes=200 * MiB, overhead_bytes=96 * MiB, page_cache_bytes=0)


def _peak(slots: int) -> int:
    """The process at its worst, written out independently of budget.py: running (interpreter, overhead, the
    dense weights, KV, C slots per layer plus the shared ones) or loading (interpreter, dense, one buffer)."""
    s = SIZES
    running = (PROCESS["baseline_bytes"] + PROCESS["overhead_bytes"] + s["non_expert_bytes"] + s["kv_bytes"]
               + (s["num_layers"] * slots + s["extra_slots"]) * s["slot_bytes"])
    loading = PROCESS["baseline_bytes"] + s["non_expert_bytes"] + PROCESS["load_bytes"]
    return max(running, loading)


@pytest.mark.parametrize("limit", [1300 * MiB, 2 * GiB, 3 * GiB, 8 * GiB])
def test_auto_takes_the_most_slots_whose_process_fits(limit):
    plan = plan_memory(budget=AUTO, slots=None, limit=limit, **SIZES, **PROCESS)
    assert plan.process_peak == _peak(plan.slots) <= limit
    assert plan.slots == SIZES["num_experts"] or _peak(plan.slots + 1) > limit
    assert plan.slots >= SIZES["top_k"]


def test_explicit_budget_beyond_the_container_names_what_fits():
    limit = 2 * GiB
    budget = limit - 512 * MiB  # docs' old advice: the interpreter (450 MiB) + overhead do not fit beside it
    with pytest.raises(BudgetError) as exc:
        plan_memory(budget=budget, slots=None, limit=limit, **SIZES, **PROCESS)
    fits = limit - PROCESS["baseline_bytes"] - PROCESS["overhead_bytes"]
    assert f"at most --memory" in str(exc.value) and f"({fits} bytes" in str(exc.value)
    plan = plan_memory(budget=fits, slots=None, limit=limit, **SIZES, **PROCESS)  # that one runs
    assert plan.process_peak <= limit
    with pytest.raises(BudgetError, match="C=64 experts per layer does not fit"):
        plan_memory(budget=None, slots=64, limit=limit, **SIZES, **PROCESS)


def test_a_container_too_small_names_the_process_minimum():
    need = _peak(SIZES["top_k"])
    for limit in (need - 1, 500 * MiB):
        with pytest.raises(BudgetError, match=rf"needs at least .* \({need} bytes\)"):
            plan_memory(budget=AUTO, slots=None, limit=limit, **SIZES, **PROCESS)
    assert plan_memory(budget=AUTO, slots=None, limit=need, **SIZES, **PROCESS).slots == SIZES["top_k"]
    # loading dominates: a 1 GiB read buffer beside the dense weights
    big = dict(PROCESS, load_bytes=GiB)
    need = PROCESS["baseline_bytes"] + SIZES["non_expert_bytes"] + GiB
    with pytest.raises(BudgetError, match=rf"\({need} bytes\).*loading peaks"):
        plan_memory(budget=AUTO, slots=None, limit=need - 1, **SIZES, **big)


def test_auto_without_a_limit_is_refused():
    with pytest.raises(ValueError, match="--memory auto"):
        plan_memory(budget=AUTO, slots=None, limit=None, **SIZES, **PROCESS)
    assert parse_bytes("auto") == AUTO and parse_bytes(" Auto ") == AUTO


# -- through the runtime and the CLI --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("plan") / "tiny", seed=2)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))


def _cgroup_of(tmp_path, limit: int) -> Path:
    return fake_tree(tmp_path / "cg", "0::/job\n", {"sys/fs/cgroup/job/memory.max": str(limit)})


class Loaded(AssertionError):
    pass


def _no_loading(monkeypatch):
    """Fail loudly if any weight is read or any sidecar written."""
    import expertcache.offload.runtime as runtime
    from expertcache.offload.checkpoint import Checkpoint

    def boom(*a, **k):
        raise Loaded("weights were loaded before the refusal")

    monkeypatch.setattr(runtime, "load_non_expert", boom)
    monkeypatch.setattr(runtime, "quantize_checkpoint", boom)
    monkeypatch.setattr(Checkpoint, "tensor", boom)
    monkeypatch.setattr(torch.nn.Module, "to_empty", boom)


@pytest.mark.parametrize("quant", [None, "int4"])
def test_refusal_comes_before_any_weight_is_read(tiny, tmp_path, monkeypatch, capsys, quant):
    """A container smaller than the process: one line naming the minimum, exit 2, and no weight read, no
    sidecar written, no module materialised (each of those raises here)."""
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT", str(_cgroup_of(tmp_path, process_rss() + 4 * MiB)))
    _no_loading(monkeypatch)
    argv = ["generate", "--model", str(tiny), "--memory", "auto", "--max-new-tokens", "2", "3 4 5"]
    code = main(argv + (["--quant", quant, "--quant-dense", "int8"] if quant else []))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "weights were loaded" not in err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "memory cgroup limit" in lines[0] and "needs at least" in lines[0], err


def test_explicit_memory_too_large_for_the_container_is_refused_before_loading(rss_model, tmp_path, monkeypatch,
                                                                              capsys):
    """rss_model: 24 MiB dense, 6 MiB experts, 2 layers of 8: C = K needs ~55 MiB, C = N ~126 MiB; the
    container leaves 80 MiB beside the interpreter and the overhead. A first call (refused too: no container
    room at all) compiles whatever the command compiles before its check, so the interpreter measured for the
    limit is the one the second call is checked against (run alone, numba's first compile grew it ~85 MiB)."""
    argv = ["generate", "--model", str(rss_model), "--memory", "200MiB", "--max-new-tokens", "2", "3 4 5"]
    _no_loading(monkeypatch)
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT", str(_cgroup_of(tmp_path / "warm", process_rss())))
    assert main(argv) == 2
    capsys.readouterr()
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT",
                       str(_cgroup_of(tmp_path, process_rss() + RUNTIME_OVERHEAD + 80 * MiB)))
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "at most --memory" in err and "--memory auto" in err, err


def test_auto_plans_within_the_fake_cgroup(tiny, tmp_path, monkeypatch):
    limit = process_rss() + 200 * MiB
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT", str(_cgroup_of(tmp_path, limit)))
    rt = OffloadedModel.from_pretrained(tiny, OffloadConfig(memory="auto", io="cached", readers=1, context=32))
    p = rt.plan
    assert p.limit == limit and p.process_peak <= limit
    assert p.budget == limit - p.beside  # the budget is what the process leaves
    assert p.slots == rt.num_experts  # 200 MiB beside the interpreter holds the whole tiny model
    assert p.page_cache_bytes == p.slot_bytes  # buffered reads, one reader
    assert json.loads(json.dumps(rt.describe()))["memory"]["process_peak"] == p.process_peak


@pytest.mark.parametrize("value,culprit", [("-1GiB", "--memory"), ("3XB", "--memory"), ("0", "--memory"),
                                           ("autox", "--memory")])
def test_bad_memory_values_exit_2(tiny, capsys, value, culprit):
    code = main(["generate", "--model", str(tiny), "--memory", value, "3 4"])
    err = capsys.readouterr().err
    assert code == 2 and culprit in err and "Traceback" not in err, err


def test_unreadable_cgroup_file_exits_2_naming_it(tiny, tmp_path, monkeypatch, capsys):
    root = fake_tree(tmp_path / "bad", "0::/job\n", {"sys/fs/cgroup/job/memory.max": "plenty"})
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT", str(root))
    code = main(["generate", "--model", str(tiny), "--memory", "auto", "3 4"])
    err = capsys.readouterr().err
    assert code == 2 and "job/memory.max" in err and "Traceback" not in err, err


# -- the plan against the measured peak RSS --------------------------------------------------------

_RSS_SCRIPT = r"""
import json, sys, torch
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig
path, policy, tier, io, quant, dense = sys.argv[1:7]
torch.set_num_threads(1)
rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier=tier, io=io, memory="auto", readers=2, context=64,
                                                        quant=None if quant == "none" else quant,
                                                        quant_dense=None if dense == "none" else dense),
                                    dtype=torch.float32, routing=RoutingConfig(policy=policy, lam=0.5))
rt.generate(torch.tensor([[5, 6, 7, 8]]), 16)
p = rt.plan
# the peak RSS of this process since its exec: VmHWM (ru_maxrss would carry the parent's peak over the
# fork + exec: Linux keeps the larger of the two, and pytest's own RSS is larger than this run's)
hwm = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps(dict(peak=p.process_peak, limit=p.limit, slots=p.slots, n=rt.num_experts, total=p.total,
                      baseline=p.baseline_bytes, maxrss=hwm)))
"""


def olmoe_checkpoint(path: Path, **shape) -> Path:
    """A random OLMoE checkpoint (float32) of 2 layers × 8 experts (D 512, F 1024: 6 MiB experts) and a
    4096-token vocabulary, saved to ``path``; ``shape`` overrides any config field."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = AutoConfig.for_model("olmoe", **{**fields, **shape})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rss_model(tmp_path_factory):
    """6 MiB float32 experts (8 per layer, 2 layers), an 8 MiB embedding: big enough that a missed term shows,
    small enough to build in a second."""
    return olmoe_checkpoint(tmp_path_factory.mktemp("rss") / "m")


_TRIM_SCRIPT = r"""
import torch
from expertcache.offload.budget import process_rss, release_free_heap
M = 2**20
big = torch.ones(8 * M, dtype=torch.uint8); del big  # glibc: its mmap threshold rises to this block's size
blocks = [torch.ones(4 * M, dtype=torch.uint8) for _ in range(20)]  # so these come from the heap
last = blocks.pop()  # in use at the heap's top: an sbrk trim alone could give back nothing below it
del blocks
held = process_rss()
release_free_heap()
print((held - process_rss()) / M)
"""


def test_release_free_heap_gives_freed_blocks_back():
    """The pattern of the quantised sidecar's writer (blocks of a few MiB allocated and freed after an mmapped
    one raised glibc's threshold) leaves ~76 MiB of free heap resident; release_free_heap returns it. Before
    it ran after the writer, a cold ``--quant int4`` run decoded on top of 20-50 MiB of such pages and its
    peak RSS once passed the plan's process peak (the slow case of the test below)."""
    import platform

    if platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"):
        pytest.skip("malloc_trim is glibc's; RSS from /proc")
    proc = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split()[-1]) >= 40, proc.stdout


@pytest.mark.parametrize("policy,tier,io,quant,dense", [
    ("cache-prior", "disk", "direct", "none", "none"),
    pytest.param("original", "host", "cached", "none", "none", marks=pytest.mark.slow),
    pytest.param("original", "disk", "cached", "int8", "none", marks=pytest.mark.slow),
    pytest.param("cache-prior", "disk", "direct", "int4", "int4", marks=pytest.mark.slow)])
def test_process_peak_bounds_the_measured_peak_rss(rss_model, tmp_path, policy, tier, io, quant, dense):
    """A real run under ``--memory auto`` in a fake cgroup sized for fewer than 8 experts per layer: the
    child's peak RSS (VmHWM, its whole life since exec: imports, loading, decoding 16 tokens) stays within
    the plan's process peak,
    and the plan over-counts by no more than its own overhead allowance (RUNTIME_OVERHEAD, 64 MiB)."""
    from expertcache.offload.store import direct_io_supported

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm")
    if io == "direct" and not direct_io_supported(rss_model / "model.safetensors"):
        pytest.skip("filesystem does not support O_DIRECT")
    # the limit: this test process's own RSS is no guide to the child's, so ask a first run with no limit
    env = dict(os.environ, OMP_NUM_THREADS="1", EXPERTCACHE_CACHE=str(tmp_path / "cache"),
               EXPERTCACHE_CGROUP_ROOT=str(_cgroup_of(tmp_path / "big", 64 * GiB)))

    def run(env):
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(rss_model), policy, tier, io, quant, dense], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    run(env)  # a first run compiles any kernel not yet in numba's cache (~85 MiB of RSS the plan does not count)
    first = run(env)  # C = N
    assert first["slots"] == first["n"]
    assert first["maxrss"] <= first["peak"], (first["maxrss"] - first["peak"]) / MiB
    assert first["peak"] - first["maxrss"] <= RUNTIME_OVERHEAD, (first["peak"] - first["maxrss"]) / MiB
    if quant != "none" or tier == "host":
        return  # small experts (int8) or every expert in RAM anyway (host tier): C < N shows nothing more
    limit = first["peak"] - first["total"] + first["total"] * 5 // 8  # fewer slots than N
    r = run(dict(env, EXPERTCACHE_CGROUP_ROOT=str(_cgroup_of(tmp_path / "small", limit))))
    assert r["limit"] == limit and 2 <= r["slots"] < r["n"]
    assert r["maxrss"] <= r["peak"] <= limit, (r["maxrss"] - r["peak"]) / MiB
    assert r["peak"] - r["maxrss"] <= RUNTIME_OVERHEAD, (r["peak"] - r["maxrss"]) / MiB


# -- a real memory cgroup (root, cgroup v1) ---------------------------------------------------------

CG = Path("/sys/fs/cgroup/memory")


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """512 MiB of float32 embedding + lm_head, tiny experts: a model whose loading alone breaks a small cgroup."""
    return olmoe_checkpoint(tmp_path_factory.mktemp("dense") / "m", vocab_size=65536, hidden_size=1024,
                            intermediate_size=64, num_hidden_layers=1, num_experts=4, max_position_embeddings=64,
                            tie_word_embeddings=False)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not (CG / "cgroup.procs").is_file(), reason="needs root and cgroup v1")
def test_real_cgroup_refuses_instead_of_being_killed(dense_model, tmp_path):
    """Inside a v1 memory cgroup that holds the interpreter but not the 512 MiB of dense weights: exit 2 with
    the one-line refusal, where loading them used to get the process killed (checked: without the preflight
    the same run is SIGKILLed); in a cgroup that holds it, ``--memory auto`` runs to the end. (A limit below
    the interpreter's own import, ~0.3 GiB with torch, kills it before any plan can exist.)"""
    cg = CG / f"expertcache-test-{os.getpid()}"
    cg.mkdir()
    try:
        def run(limit):
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            script = (f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m expertcache.cli.main generate "
                      f"--model {dense_model} --memory auto --max-new-tokens 4 '3 4 5'")
            return subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1", EXPERTCACHE_CACHE=str(tmp_path)))

        small = run(700 * MiB)  # the plan counts the cgroup charge of the interpreter (~340 MiB), not its RSS
        assert small.returncode == 2, (small.returncode, small.stderr[-1500:])
        assert "needs at least" in small.stderr and "Traceback" not in small.stderr
        ok = run(1600 * MiB)
        assert ok.returncode == 0, (ok.returncode, ok.stderr[-1500:])
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)


@pytest.mark.parametrize("limit_mib,refused", [(383, True), (384, False)])
def test_a_cgroup_below_the_interpreter_is_refused_before_torch_is_imported(tmp_path, limit_mib, refused):
    """A memory cgroup smaller than the interpreter with torch imported (``IMPORT_FLOOR``, 384 MiB) used to kill
    `generate` while it imported torch (¼ of a 1.16 GB Q4_K_M file: OOM-killed after 4 s, no message); now one
    line naming the limit, exit 2, and torch never imported. At exactly the floor the check lets it through
    (the plan decides later). The fake tree is read through $EXPERTCACHE_CGROUP_ROOT, like the plan's."""
    import subprocess
    import sys

    from expertcache.container import IMPORT_FLOOR

    assert IMPORT_FLOOR == 384 * MiB
    m = "sys/fs/cgroup/memory"
    root = fake_tree(tmp_path, "12:memory:/job\n", {f"{m}/job/memory.limit_in_bytes": str(limit_mib * MiB)})
    code = ("import sys; from expertcache.cli.main import main; rc = main(['generate', '--no-such-flag']); "
            "print('RC', rc, 'torch' in sys.modules)")
    env = dict(os.environ, EXPERTCACHE_CGROUP_ROOT=str(root))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if refused:
        assert "RC 2 False" in out.stdout, out
        assert out.stderr.strip().splitlines() == [
            f"expertcache generate: error: the memory cgroup allows {limit_mib} MiB, less than the 384 MiB this "
            "process needs before it can load a model (Python, torch, transformers); give the cgroup more memory"]
    else:  # past the check: the command's own parser runs (torch imported) and refuses the call for its own reason
        assert "RC 2 True" in out.stdout and "memory cgroup" not in out.stderr, out
