"""Offloaded runtime invariants (CPU, tiny random models): logits equal the in-memory model at every cache
size, live counts equal the simulator's replay, damaged checkpoints fail loudly, the disk tier really reads
the device, the memory budget, quantised experts, prefetch, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from expertcache.models import load_model
from expertcache.models.adapters import FAMILIES
from expertcache.models.tiny import TINY_ARCHS, save_tiny
from expertcache.offload import BudgetError, CheckpointError, OffloadConfig, OffloadedModel, plan_memory
from expertcache.offload.budget import parse_bytes
from expertcache.offload.checkpoint import Checkpoint, read_header
from expertcache.offload.store import DiskTier, direct_io_supported
from expertcache.offload.writer import write_safetensors
from expertcache.routing import RoutingConfig
from conftest import decode_logits as _offloaded_logits
from expertcache.sim import replay

ARCHS = TINY_ARCHS  # every family's tiny configs (models/adapters.py: Family.tiny)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: save_tiny(a, root / a, seed=3) for a in ARCHS}


def _n_experts(cfg) -> int:
    return getattr(cfg, "num_experts", None) or cfg.num_local_experts


def _rt(path, capacity=None, **kw):
    io = kw.pop("io", "cached")
    tier = kw.pop("tier", "disk")
    quant = kw.pop("quant", None)
    group = kw.pop("group", None)
    readers = kw.pop("readers", 2)
    prefetch = kw.pop("prefetch", 0)
    return OffloadedModel.from_pretrained(path, OffloadConfig(tier=tier, io=io, capacity=capacity, quant=quant,
                                                              group=group, readers=readers, prefetch=prefetch),
                                          dtype=torch.float32, **kw)


def _reference_logits(path, ids_BS):
    ref = load_model(path)
    with torch.no_grad():
        return ref(ids_BS).logits



@pytest.mark.parametrize("arch", ARCHS)
def test_original_logits_equal_in_memory_at_every_capacity(tiny_dir, arch):
    path = tiny_dir[arch]
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    want = _reference_logits(path, ids)
    want1 = want[:1]
    rt = _rt(path, capacity=1)
    n = rt.num_experts
    for c in range(1, n + 1):
        rt.configure(capacity=c)
        got = _offloaded_logits(rt, ids, prefill=3)  # batch 2: union steps
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{arch} C={c} batch 2")
        rt.configure()
        got1 = _offloaded_logits(rt, ids[:1], prefill=1)  # batch 1, one token per step
        torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5, msg=f"{arch} C={c} batch 1")
        s = rt.stats()
        assert s["hits"] + s["misses"] == s["accesses"] > 0
        # every demand miss is one load (into a slot, or the scratch slot when C < K) and nothing else loads:
        # no prefetch here; and every load reads one expert's bytes
        assert s["prefetched"] == 0 and s["expert_loads"] == s["misses"] + s["prefetched"]
        assert s["bytes_read"] == s["expert_loads"] * rt.expert_bytes


@pytest.mark.parametrize("arch", ARCHS)
def test_reader_threads_and_prefetch_leave_logits_bit_identical(tiny_dir, arch):
    """The serial runtime (reads on the compute thread) and the overlapped one (1 or 3 reader threads, with
    and without next-layer prefetch) give bit-identical logits: arrival order never changes the combine."""
    path = tiny_dir[arch]
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    want = _reference_logits(path, ids)
    serial = _rt(path, capacity=2, readers=0)
    n, k = serial.num_experts, serial.top_k
    variants = [_rt(path, capacity=2, readers=r, prefetch=p) for r, p in ((1, 0), (3, 0), (1, k), (3, 2))]
    for c in sorted({1, 2, k, n // 2, n}):
        serial.configure(capacity=c)
        ref2, ref1 = _offloaded_logits(serial, ids, 3), None
        serial.configure()
        ref1 = _offloaded_logits(serial, ids[:1], 1)
        torch.testing.assert_close(ref2, want, rtol=1e-5, atol=1e-5)
        for rt in variants:
            rt.configure(capacity=c)
            assert torch.equal(_offloaded_logits(rt, ids, 3), ref2), f"{arch} C={c} {rt.offload}"
            rt.configure()
            assert torch.equal(_offloaded_logits(rt, ids[:1], 1), ref1), f"{arch} C={c} {rt.offload}"
    pf = variants[2].prefetch_stats.to_dict()
    assert pf["guessed"] > 0 and 0 <= pf["precision"] <= 1 and 0 <= pf["recall"] <= 1


def test_prefetch_counts_and_replay(tiny_dir):
    """With prefetch on, the cache's hits/misses still equal the simulator's replay; every read is either a
    demand miss not served from a spare or a prefetch, and bytes read count both."""
    rt = _rt(tiny_dir["olmoe"], capacity=3, record=True, readers=2, prefetch=2,
             routing=RoutingConfig("cache-prior", lam=0.5))
    rt.generate(torch.tensor([[5]]), 25)
    sim = replay(rt.recorded_ids_TLK(), rt.num_experts, 3, eviction="lru")
    live = rt.cache_stats()
    for a, b in zip(live, sim.per_layer):
        assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)
    ps, s = rt.prefetch_stats, rt.stats()
    misses = sum(x.misses for x in live)
    assert ps.issued > 0 and ps.used > 0
    assert s["expert_loads"] == misses - ps.used + ps.issued
    assert s["bytes_read"] == rt.expert_bytes * s["expert_loads"]
    assert s["prefetch"]["unused_bytes"] == (ps.issued - ps.used) * rt.expert_bytes


@pytest.mark.parametrize("policy,eviction", [(RoutingConfig("cache-prior", lam=0.5), "lru"),
                                             (RoutingConfig("max-rank", m=4), "lfu"),
                                             (RoutingConfig(), "gamma")])
def test_live_counts_equal_replay(tiny_dir, policy, eviction):
    rt = _rt(tiny_dir["olmoe"], capacity=3, routing=policy, eviction=eviction, record=True)
    r = rt.generate(torch.tensor([[5]]), 25)
    assert r["tokens"].shape == (1, 25)
    ids_TLK = rt.recorded_ids_TLK()
    assert ids_TLK.shape[:2] == (25, len(rt.layers))
    sim = replay(ids_TLK, rt.num_experts, 3, eviction=eviction)
    live = rt.cache_stats()
    for li, (a, b) in enumerate(zip(live, sim.per_layer)):
        assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions), f"layer {li}"
    assert rt.stats()["expert_loads"] == sum(s.misses for s in live)
    assert rt.stats()["bytes_read"] == rt.expert_bytes * sum(s.misses for s in live)


def test_cache_aware_policy_raises_hit_rate(tiny_dir):
    rates = {}
    for name, rc in (("lru", RoutingConfig()), ("cp", RoutingConfig("cache-prior", lam=1.0))):
        rt = _rt(tiny_dir["olmoe"], capacity=3, routing=rc)
        rt.generate(torch.tensor([[5, 9, 11]]), 30)
        rates[name] = rt.stats()["hit_rate"]
    assert rates["cp"] > rates["lru"]


def test_host_tier_and_fused_layout_match(tiny_dir, tmp_path):
    path = tiny_dir["olmoe"]
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    want = _reference_logits(path, ids)
    torch.testing.assert_close(_offloaded_logits(_rt(path, 3, tier="host"), ids, 2), want, rtol=1e-5, atol=1e-5)
    # rewrite the checkpoint with transformers' fused [E, 2F, D] / [E, D, F] expert tensors
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    ckpt = Checkpoint(path, FAMILIES["olmoe"].disk, 8)
    entries, layers = [], sorted({int(k.split(".")[2]) for k in ckpt.entries if ".experts." in k})
    for k, t in ckpt.entries.items():
        if ".experts." not in k:
            entries.append((k, t.dtype, t.shape, (lambda k=k: ckpt.tensor(k))))
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        gu = torch.stack([torch.cat([ckpt.tensor(f"{p}{e}.gate_proj.weight"), ckpt.tensor(f"{p}{e}.up_proj.weight")])
                          for e in range(8)])
        down = torch.stack([ckpt.tensor(f"{p}{e}.down_proj.weight") for e in range(8)])
        entries += [(p + "gate_up_proj", gu.dtype, tuple(gu.shape), (lambda t=gu: t)),
                    (p + "down_proj", down.dtype, tuple(down.shape), (lambda t=down: t))]
    write_safetensors(fused / "model.safetensors", entries)
    torch.testing.assert_close(_offloaded_logits(_rt(fused, 2), ids, 2), want, rtol=1e-5, atol=1e-5)


def test_prefetch_loads_without_demand_misses(tiny_dir):
    rt = _rt(tiny_dir["olmoe"], capacity=4)
    assert rt.prefetch(0, [1, 2, 3]) == 3
    assert rt.states[0].cache.resident() == {1, 2, 3}
    s = rt.stats()
    assert (s["accesses"], s["misses"], s["prefetched"], s["expert_loads"]) == (0, 0, 3, 3)
    assert rt.prefetch(0, [1, 2]) == 0


# -- damaged checkpoints ---------------------------------------------------------------------------


def test_truncated_checkpoint_fails_clearly(tiny_dir, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_dir["olmoe"], bad)
    f = bad / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        _rt(bad, 2)


def test_corrupt_header_fails_clearly(tiny_dir, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_dir["olmoe"], bad)
    f = bad / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(9)
        fh.write(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        _rt(bad, 2)
    with open(f, "r+b") as fh:
        fh.write(struct.pack("<Q", 10**12))
    with pytest.raises(CheckpointError, match="header length"):
        read_header(f)


def test_read_error_in_reader_thread_surfaces(tiny_dir, tmp_path):
    """A reader thread that fails raises its error (naming the file) in the caller -- no hang, no wrong
    answer -- and the runtime restarts with empty caches and keeps working."""
    path = tmp_path / "m"
    shutil.copytree(tiny_dir["olmoe"], path)
    ids = torch.tensor([[5, 6, 7]])
    want = _offloaded_logits(_rt(path, 2, readers=0), ids, 1)
    rt = _rt(path, 2, readers=3, prefetch=2)
    real = rt.tier.read
    calls = {"n": 0}

    def failing(parts, placement, dest):  # the device fails from the third read on: with 3 readers and
        calls["n"] += 1                      # prefetch the third may be a guess nobody waits for, a later
        if calls["n"] >= 3:                  # demand read is not
            raise OSError(5, "reading expert bytes failed (Input/output error)", str(parts.reads[0].file))
        return real(parts, placement, dest)

    rt.tier.read = failing
    with pytest.raises(OSError, match="model.safetensors"):
        _offloaded_logits(rt, ids, 1)
    assert all(len(st.cache.resident()) == 0 and not st.pool.pending for st in rt.states)
    rt.tier.read = real
    rt.configure()
    assert torch.equal(_offloaded_logits(rt, ids, 1), want)
    # the file shrinks after it was opened: a short read is a CheckpointError naming the file
    rt.configure()
    with open(path / "model.safetensors", "r+b") as fh:
        fh.truncate(rt.checkpoint.entries["model.embed_tokens.weight"].start + 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: short read"):
        _offloaded_logits(rt, ids, 1)


def test_missing_expert_key_fails_clearly(tiny_dir, tmp_path):
    bad = tmp_path / "missing"
    shutil.copytree(tiny_dir["mixtral"], bad)
    ckpt = Checkpoint(tiny_dir["mixtral"], FAMILIES["mixtral"].disk, 8)
    gone = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    entries = [(k, t.dtype, t.shape, (lambda k=k: ckpt.tensor(k))) for k, t in ckpt.entries.items() if k != gone]
    write_safetensors(bad / "model.safetensors", entries)
    with pytest.raises(CheckpointError, match="missing expert key.*experts.5.w3"):
        _rt(bad, 2)


def test_unsupported_family_lists_supported(tiny_dir, tmp_path):
    bad = tmp_path / "dense"
    shutil.copytree(tiny_dir["olmoe"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="olmoe, mixtral, qwen2_moe, qwen3_moe, deepseek_v2"):
        _rt(bad, 2)


# -- the disk tier really reads the device ----------------------------------------------------------


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("read_bytes:")).split()[1])


@pytest.mark.parametrize("io", ["direct", "fadvise"])
def test_flash_faithful_reads_hit_the_device(tiny_dir, tmp_path, io):
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io on this system")
    path = tmp_path / "m.safetensors"
    write_safetensors(path, [(f"model.layers.0.mlp.experts.0.{n}.weight", torch.float32, (256, 256),
                              lambda: torch.randn(256, 256)) for n in ("down_proj", "gate_proj", "up_proj")])
    if io == "direct" and not direct_io_supported(path):
        pytest.skip("filesystem does not support O_DIRECT")
    ckpt = Checkpoint(tmp_path, FAMILIES["olmoe"].disk, 1)
    parts = ckpt.expert(0, 0)
    tier = DiskTier(io)
    dest = torch.empty(parts.nbytes, dtype=torch.uint8)
    tier.fetch(parts, dest)  # warm the page cache as much as a buffered reader would
    with open(path, "rb") as f:
        f.read()
    before = _read_bytes()
    for _ in range(3):
        tier.fetch(parts, dest)
    moved = _read_bytes() - before
    if moved == 0 and io == "fadvise":
        pytest.skip("read_bytes not accounted for buffered reads on this filesystem")
    assert moved >= 3 * parts.nbytes, f"{io}: only {moved} bytes read from the device for 3 × {parts.nbytes}"
    want = torch.cat([ckpt.tensor(f"model.layers.0.mlp.experts.0.{n}.weight").reshape(-1)
                      for n in ("down_proj", "gate_proj", "up_proj")])
    assert torch.equal(dest.view(torch.float32), want)


# -- memory budget --------------------------------------------------------------------------------


def test_budget_slots_and_refusal(tiny_dir):
    assert parse_bytes("3GiB") == 3 * 2**30 and parse_bytes("1.5MB") == 1_500_000 and parse_bytes("77") == 77
    with pytest.raises(ValueError):
        parse_bytes("lots")
    plan = plan_memory(budget=parse_bytes("minimum"), slots=None, non_expert_bytes=1000, kv_bytes=1000,
                       expert_bytes=100, num_layers=4, num_experts=64, top_k=2)
    assert (plan.slots, plan.budget, plan.total) == (2, 2800, 2800)
    plan = plan_memory(budget=10_000, slots=None, non_expert_bytes=1000, kv_bytes=1000, expert_bytes=100,
                       num_layers=4, num_experts=64, top_k=2)
    assert plan.slots == 20 and plan.total <= 10_000
    with pytest.raises(BudgetError, match=r"at least .*\(2800 bytes\)"):
        plan_memory(budget=2799, slots=None, non_expert_bytes=1000, kv_bytes=1000, expert_bytes=100, num_layers=4,
                    num_experts=64, top_k=2)
    rt = _rt(tiny_dir["olmoe"])
    assert rt.capacity == rt.num_experts
    minimum = rt.plan.minimum
    small = OffloadedModel.from_pretrained(tiny_dir["olmoe"], OffloadConfig(io="cached", memory=minimum),
                                           dtype=torch.float32)
    assert small.capacity == small.top_k
    named = OffloadedModel.from_pretrained(tiny_dir["olmoe"], OffloadConfig(io="cached", memory="minimum"),
                                           dtype=torch.float32)  # docs/OFFLOAD.md: --memory minimum gives C = K
    assert named.capacity == named.top_k and named.plan.budget == named.plan.total == minimum
    with pytest.raises(BudgetError, match=f"need at least .*{minimum} bytes"):
        OffloadedModel.from_pretrained(tiny_dir["olmoe"], OffloadConfig(io="cached", memory=minimum - 1),
                                       dtype=torch.float32)


_RSS_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM
from expertcache.offload import OffloadConfig, OffloadedModel
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
path, io, c, p = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with torch.device("meta"):  # import the modeling code first: importing it is not the run's memory
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
from expertcache.cache import make_cache  # nor is loading the compiled cache kernels (numba, LLVM)
make_cache("lru", 8, 2).access_step([0, 1])
r0 = rss()
rt = OffloadedModel.from_pretrained(path, OffloadConfig(io=io, capacity=c, readers=3, prefetch=p, context=64),
                                    dtype=torch.float32)
rt.generate(torch.tensor([[5, 6, 7, 8]]), 16)
s = rt.stats()
print(json.dumps(dict(growth=rss() - r0, plan=rt.plan.total, layers=len(rt.layers), expert_bytes=rt.expert_bytes,
                      loads=s["expert_loads"])))
"""

#: what a run allocates outside the memory plan: interpreter and torch kernel state, per-op temporaries,
#: reader-thread stacks (measured: 6-12 MiB on this VM; docs/OFFLOAD.md states 24 MiB)
RSS_OVERHEAD = 24 * 2**20


@pytest.mark.parametrize("io,c,p", [("direct", 2, 2), pytest.param("direct", 2, 0, marks=pytest.mark.slow),
                                   pytest.param("cached", 4, 0, marks=pytest.mark.slow)])
def test_rss_growth_stays_within_plan(tmp_path_factory, io, c, p):
    """The process's RSS growth over building and running the runtime stays within the memory plan plus a
    fixed overhead; 6 MiB experts, 16 in all (96 MiB), so loading them all would break the bound."""
    import subprocess
    import sys

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm")
    path = tmp_path_factory.getbasetemp() / "rss-model"
    if not (path / "model.safetensors").is_file():
        from test_memory_plan import olmoe_checkpoint

        olmoe_checkpoint(path, vocab_size=128)
    if io == "direct" and not direct_io_supported(path / "model.safetensors"):
        pytest.skip("filesystem does not support O_DIRECT")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), io, str(c), str(p)], env=env,
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["loads"] > r["layers"] * c  # slots really filled and replaced
    assert r["growth"] >= r["layers"] * c * r["expert_bytes"]  # the measurement sees the slots
    assert r["growth"] <= r["plan"] + RSS_OVERHEAD, (r["growth"] - r["plan"]) / 2**20


# -- quantised experts ----------------------------------------------------------------------------


def test_quantised_offload_runs_and_stays_close(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q"
    shutil.copytree(tiny_dir["olmoe"], path)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    want = _reference_logits(path, ids)
    for mode, tol in (("int8", 0.05), ("int4", 0.5)):
        rt = _rt(path, 3, quant=mode)
        assert rt.source.path.is_file() and f"expertcache-experts-v2-{mode}-" in rt.source.path.name
        assert not any(p.name.startswith("expertcache-") for p in path.iterdir())  # model folder untouched
        got = _offloaded_logits(rt, ids, 2)
        assert (got - want).abs().max().item() < tol
        assert rt.expert_bytes < 3 * 32 * 32 * 4  # smaller than fp32 experts


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_generate_and_bench(tiny_dir, tmp_path, capsys):
    from expertcache.cli.main import main

    path = str(tiny_dir["qwen2_moe"])
    assert main(["generate", "--model", path, "--cache-experts", "2", "--io", "cached", "--routing", "cache-prior",
                 "--lam", "0.5", "--max-new-tokens", "5", "--dtype", "float32", "5 6 7"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 5 and "tok/s" in cap.err and "hit rate" in cap.err and "MiB read" in cap.err
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--model", path, "--cache-experts", "4", "--io", "cached", "--tokens", "4",
                 "--repeats", "1", "--policies", "original+lru", "cache-prior", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| cache-prior |" in text and "measured/floor" in text
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert {r["name"] for r in rows} == {"original+lru", "cache-prior"}
    assert all(r["config"]["capacity"] == 4 for r in rows)
    expert_bytes = rows[0]["config"]["expert_bytes"]
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    for r in rows:  # the floor's numbers: floor = max(compute, bytes / bandwidth); serial = compute + bytes / serial bw
        assert r["bandwidth"] > 0 and r["serial_bandwidth"] > 0 and r["t_compute"] > 0
        assert r["tokens"] in (3, 4)  # decode steps of 4 tokens
        assert r["bytes_per_token"] == pytest.approx(r["misses_per_token"] * expert_bytes)
        floor = max(r["t_compute"], r["bytes_per_token"] / r["bandwidth"])
        assert r["floor_s_per_token"] == pytest.approx(floor, rel=1e-9)
        assert r["floor_ratio"] == pytest.approx(r["s_per_token"] / r["floor_s_per_token"], rel=1e-9)
        serial = r["t_compute"] + r["bytes_per_token"] / r["serial_bandwidth"]
        assert r["serial_s_per_token"] == pytest.approx(serial, rel=1e-9)
        assert r["tok_s"] == pytest.approx(1 / r["s_per_token"], rel=1e-9)  # batch 1
        # the printed table (medians of one repeat = this row)
        cols = table[r["name"]]
        assert cols[4:11] == [f"{r['bytes_per_token'] / 2**20:.1f}", f"{r['s_per_token'] * 1e3:.1f}",
                              f"{r['t_compute'] * 1e3:.1f}", f"{r['floor_s_per_token'] * 1e3:.1f}",
                              f"{r['floor_ratio']:.2f}", f"{r['serial_s_per_token'] * 1e3:.1f}",
                              f"{r['serial_ratio']:.2f}"]
        assert cols[3] == f"{r['hit_rate']:.3f}"
    assert main(["generate", "--model", path, "--cache-experts", "2", "--io", "cached", "--readers", "0", "--prefetch",
                 "--max-new-tokens", "3", "--dtype", "float32", "--json", "5 6 7"]) == 0
    row = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert row["config"]["memory"]["extra_slots"] == 1 + 2 * 4 and row["prefetch"]["guessed"] > 0  # P = 2K shared spares
    assert main(["generate", "--model", path, "--memory", "1KiB", "--io", "cached", "5"]) == 2
    assert "at least" in capsys.readouterr().err


def test_make_model_keys_match_transformers_layout():
    from expertcache.offload.make_model import _disk_entries

    got = _disk_entries("mixtral", "model.layers.3.mlp.experts.gate_up_proj", (2, 8, 4))
    assert got == [("model.layers.3.block_sparse_moe.experts.0.w1.weight", (4, 4)),
                   ("model.layers.3.block_sparse_moe.experts.0.w3.weight", (4, 4)),
                   ("model.layers.3.block_sparse_moe.experts.1.w1.weight", (4, 4)),
                   ("model.layers.3.block_sparse_moe.experts.1.w3.weight", (4, 4))]
    assert _disk_entries("olmoe", "model.layers.0.mlp.experts.down_proj", (1, 4, 2)) == \
        [("model.layers.0.mlp.experts.0.down_proj.weight", (4, 2))]


_SHRINK = {
    "deepseek-v2-lite": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=16, bos_token_id=1,
                             eos_token_id=2),
    "qwen3-30b-a3b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                          bos_token_id=1, eos_token_id=2),
    "gpt-oss-20b": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_local_experts=8, eos_token_id=2, pad_token_id=0),
}


@pytest.mark.parametrize("name", sorted(_SHRINK))
def test_make_model_new_shapes_offload_and_match(tmp_path, name):
    """--make-model for DeepSeek-V2-Lite, Qwen3-30B-A3B and gpt-oss-20b (layer count selectable; shrunk
    widths here): architectures and a tokenizer are written, and the offloaded logits match transformers."""
    from expertcache.offload.make_model import BENCH_MODELS, make_bench_model
    from transformers import AutoTokenizer

    from expertcache.models.adapters import family_for, find_moe_layers
    from expertcache.offload.make_model import _layer_types
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(BENCH_MODELS[name], num_hidden_layers=2)  # the published shape (on meta: nothing allocated)
    _layer_types(kw)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    moe = find_moe_layers(meta, family_for(cfg))
    assert (moe[0].num_experts, moe[0].top_k) == {"deepseek-v2-lite": (64, 6), "qwen3-30b-a3b": (128, 8),
                                                  "gpt-oss-20b": (32, 4)}[name]
    path = make_bench_model(name, layers=3, out=tmp_path / name, dtype=torch.float32, overrides=_SHRINK[name])
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"][0].endswith("ForCausalLM") and cfg["num_hidden_layers"] == 3
    assert AutoTokenizer.from_pretrained(path)("apt-get install").input_ids
    ids = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(0))
    want = _reference_logits(path, ids)
    rt = _rt(path, capacity=2, prefetch=2)
    torch.testing.assert_close(_offloaded_logits(rt, ids, 2), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_make_bench_model_olmoe_one_layer(tmp_path):
    from expertcache.offload.make_model import make_bench_model

    path = make_bench_model("olmoe-1b-7b", layers=1, out=tmp_path / "olmoe")
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(capacity=32, io="cached"))
    assert rt.expert_bytes == 3 * 2048 * 1024 * 2 and rt.num_experts == 64 and rt.top_k == 8
    r = rt.generate(torch.randint(0, 50304, (1, 4)), 3)
    assert r["tokens"].shape == (1, 3)


# -- threads --------------------------------------------------------------------------------------


def test_threads_flag_on_every_model_command_and_auto_rule():
    from expertcache.cli.common import SMALL_HIDDEN, default_threads
    from expertcache.cli.main import build_parser

    parser = build_parser()
    for argv in (["generate", "x"], ["bench"], ["eval", "--task", "wikitext"], ["sweep", "--out", "o"], ["sensitivity", "--out", "o"],
                 ["trace", "record", "--out", "t"], ["mole", "generate", "m", "p"], ["mole", "eval", "m"],
                 ["mole", "export", "m", "--out", "o"], ["train"]):
        args = parser.parse_args(argv + ["--threads", "3"])
        assert args.threads == 3, argv
    assert parser.parse_args(["generate", "x"]).threads == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--threads", "0"])
    assert default_threads(None, 64) == 1 and default_threads(SMALL_HIDDEN - 1, 64) == 1
    assert default_threads(2048, 2) == 1 and default_threads(2048, 8) == 4 and default_threads(4096, 64) == 8


def test_io_queue_completes_every_ticket_and_stops_its_threads():
    import gc
    import queue as _queue
    import threading
    import time

    from expertcache.offload.ioqueue import IOQueue

    for readers in (0, 3):
        q = IOQueue(readers)
        done = _queue.SimpleQueue()
        ok = q.submit(lambda: 7, tag="a", done=done)

        def bad():
            raise OSError(5, "Input/output error", "/data/model.safetensors")

        failed = q.submit(bad, tag="b", done=done)
        assert {done.get(timeout=5).tag, done.get(timeout=5).tag} == {"a", "b"}  # both complete, none hangs
        assert ok.wait().nbytes == 7
        with pytest.raises(OSError, match="model.safetensors"):
            failed.wait()
    before = threading.active_count()
    del q
    gc.collect()
    for _ in range(50):
        if threading.active_count() <= before - 3:
            break
        time.sleep(0.02)
    assert threading.active_count() <= before - 3  # an unused queue stops its reader threads


def test_bench_repeats_keep_the_eras_profile(tiny_dir, tmp_path, capsys):
    """Every round re-measures the bandwidth, which empties the caches (``configure()``): that must keep the
    ERAS-bias profile, so ``bench --repeats 2`` with eras-bias last in round 1 runs both rounds (it exited 2)."""
    from expertcache.cli.main import main

    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--model", str(tiny_dir["qwen2_moe"]), "--cache-experts", "4", "--io", "cached",
                 "--tokens", "3", "--repeats", "2", "--policies", "original+lru", "eras-bias", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["repeat"], r["name"]) for r in rows) == [(0, "eras-bias"), (0, "original+lru"),
                                                              (1, "eras-bias"), (1, "original+lru")]
