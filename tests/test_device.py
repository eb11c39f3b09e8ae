"""Issue 23: every tensor a decode step of the offloaded runtime creates is made on the compute device.

On the CPU the guard is :mod:`device_guard`: the step runs with the default device ``meta``, so a tensor
created without naming its device (the bug that made every family fail at its first forward on CUDA) shows up
as an op touching ``meta``. ``test_gpu.py`` runs the same steps on CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from device_guard import record_step
from conftest import decode_logits
from expertcache.models import SUPPORTED_MODEL_TYPES
from expertcache.models.tiny import save_tiny
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig

ARCHS = SUPPORTED_MODEL_TYPES  # every registered family (models/adapters.py: FAMILIES)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: save_tiny(a, root / a, seed=4) for a in ARCHS}


def decode_steps(rt, device="cpu", guard=record_step):
    """Prefill 3 tokens (rows 1 and 2), then one guarded decode step each: the one-token path and the
    union path. Returns the recorders."""
    recs = []
    for rows in (1, 2):
        ids = torch.randint(3, 100, (rows, 4), generator=torch.Generator().manual_seed(rows)).to(device)
        with torch.inference_mode():
            past = rt.forward(ids[:, :3], DynamicCache(config=rt.config)).past_key_values
        out, rec = guard(rt.forward, ids[:, 3:], past)
        assert out.logits.device.type == torch.device(device).type
        recs.append(rec)
    return recs


def _assert_clean(recs, what):
    for rec in recs:
        assert not rec.meta, f"{what}: tensors made without a device: {rec.meta[:3]}"
        assert not rec.mixed, f"{what}: ops mixing devices: {rec.mixed[:3]}"


# transformers' own PhiMoE rotary embedding (longrope) builds a tensor without a device and moves it itself:
# not ours, and it fails under the meta default; test_gpu.py covers phimoe on CUDA
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "phimoe"])
def test_decode_step_makes_no_tensor_off_device(tiny_dir, arch):
    for routing, readers, prefetch, tier in ((RoutingConfig(), 0, 0, "host"),
                                             (RoutingConfig("cache-prior", lam=0.5), 2, 2, "disk")):
        rt = OffloadedModel.from_pretrained(tiny_dir[arch], OffloadConfig(tier=tier, io="cached", capacity=2,
                                                                          readers=readers, prefetch=prefetch),
                                            dtype=torch.float32, routing=routing)
        _assert_clean(decode_steps(rt), f"{arch} {routing.policy} readers={readers} prefetch={prefetch}")
        rt.close()


def test_guard_catches_a_tensor_made_without_device():
    """The guard itself: a CPU-default tensor next to a device tensor is reported."""
    x = torch.ones(3)
    _, rec = record_step(lambda: x + 1)
    assert not rec.meta and rec.ops["aten.add"] == 1
    _, rec = record_step(lambda: torch.zeros(3) * 2)
    assert rec.meta


def test_generate_and_sampling_stay_on_device(tiny_dir):
    rt = OffloadedModel.from_pretrained(tiny_dir["olmoe"], OffloadConfig(tier="host", capacity=2, readers=0),
                                        dtype=torch.float32)
    with torch.inference_mode():
        want = rt.generate(torch.tensor([[5, 6]]), 4, temperature=0.8, seed=3)["tokens"]
    got, rec = record_step(rt.generate, torch.tensor([[5, 6]], device="cpu"), 4, temperature=0.8, seed=3)
    assert torch.equal(got["tokens"], want)
    _assert_clean([rec], "generate")


# -- --device on every command that runs a model ----------------------------------------------------

MODEL_COMMANDS = (["generate", "hi"], ["melinoe", "predictor"], ["melinoe", "finetune"], ["bench", "--model", "granular"], ["eval", "--task", "wikitext"],
                  ["serve", "--model", "granular"], ["sweep", "--out", "o"], ["sensitivity", "--out", "o"],
                  ["mole", "generate", "m", "p"])


def test_device_flag_on_every_model_command():
    from expertcache.cli.main import build_parser

    parser = build_parser()
    for argv in MODEL_COMMANDS:
        assert parser.parse_args(argv).device == "auto", argv
        assert parser.parse_args(argv + ["--device", "CUDA:1"]).device.lower() == "cuda:1", argv
        assert parser.parse_args(argv + ["--device", "cpu"]).device == "cpu", argv


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no CUDA device (faked, so the refusals are checked on a GPU machine too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_resolve_device_auto_and_cpu(no_cuda):
    """Without a visible CUDA device ``auto`` is the CPU (with one: tests/test_survivors.py, a faked count)."""
    from expertcache.device import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-new-tokens", "2"],
                                  ["melinoe", "predictor", "--out", "never-written-predictor"],
                                  ["melinoe", "finetune", "--out", "never-written-finetune"],
                                  ["bench", "--model", "granular", "--tokens", "2"],
                                  ["eval", "--task", "wikitext", "--limit", "1"],
                                  ["mole", "generate", "m", "p"]])
@pytest.mark.parametrize("device,why", [("cuda", "--device cuda"), ("cuda:1", "--device cuda:1"),
                                        ("bogus", "--device")])
def test_device_without_cuda_is_one_line_exit_2(argv, device, why, capsys, no_cuda):
    from expertcache.cli.main import main

    assert main(argv + ["--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err


def test_lm_eval_adapter_refuses_a_missing_device(no_cuda):
    pytest.importorskip("lm_eval")
    from expertcache.integrations.lm_eval import ExpertCacheLM

    with pytest.raises(ValueError, match="--device cuda"):
        ExpertCacheLM(pretrained="granular", device="cuda")
    with pytest.raises(ValueError, match="--device"):
        ExpertCacheLM(pretrained="granular", device="tpu")
    assert ExpertCacheLM(pretrained="granular", device="cpu").device == torch.device("cpu")


def test_gpu_check_help_and_refusal_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "pytest -m gpu" in res.stdout
    import os

    no_gpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the refusal, checked on a GPU machine too
    res = subprocess.run([sys.executable, str(script), "--out-dir", "never-written"], capture_output=True, text=True,
                         env=no_gpu)
    assert res.returncode == 2 and not Path("never-written").exists()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


class _FakeEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU: records which stream recorded it; a timed pair is 1 ms
    apart."""

    log: list = []

    def __init__(self, enable_timing: bool = False):
        self.timed = enable_timing

    def record(self, stream=None):
        _FakeEvent.log.append(("record", id(self)))

    def synchronize(self):
        _FakeEvent.log.append(("synchronize", id(self)))

    def elapsed_time(self, end):
        assert self.timed and end.timed
        _FakeEvent.log.append(("elapsed", id(self)))
        return 1.0


class _FakeStream:
    def wait_event(self, event):
        _FakeEvent.log.append(("wait", id(event)))

    def synchronize(self):
        _FakeEvent.log.append(("stream_sync", None))


@pytest.mark.parametrize("tier,readers,host_memory", [("host", 0, None), ("host", 2, None), ("disk", 2, None),
                                                      ("disk", 2, "64KiB")])
def test_cuda_copy_path_runs_with_stand_in_streams(tiny_dir, monkeypatch, tier, readers, host_memory):
    """The CUDA read path (step.py ``_cuda_job``: copy stream, per-slot events, pinned staging) cannot run here;
    with stand-in streams and events it runs on CPU tensors: the same logits as the CPU path, every slot's
    ready event waited for by the compute stream, every copy ordered after a free event."""
    import contextlib

    path = tiny_dir["olmoe"]
    cfg = OffloadConfig(tier=tier, io="cached", capacity=2, readers=readers, prefetch=2, host_memory=host_memory)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(4))

    def logits(rt):
        got = decode_logits(rt, ids, 2)
        rt.close()
        return got

    want = logits(OffloadedModel.from_pretrained(path, cfg, dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    rt = OffloadedModel.from_pretrained(path, cfg, dtype=torch.float32)
    rt.reads.cuda, rt.reads.copy_stream = True, _FakeStream()
    monkeypatch.setattr(rt.reads, "pinned_buffer", lambda n: torch.empty(n, dtype=torch.uint8))
    _FakeEvent.log.clear()
    assert torch.equal(logits(rt), want)
    log = _FakeEvent.log
    records = [i for k, i in log if k == "record"]
    waits = [i for k, i in log if k == "wait"]
    assert records and set(waits) <= set(records)
    # issue 35: close() drained the copy stream before the slots could be freed
    assert ("stream_sync", None) in log
    s = rt.stats()
    assert s["misses"] > 0 and not rt.reads.slot_free
    # issue 35: the compute stream's waits on copies, timed by event pairs, are booked as io_wait (seconds)
    timed = sum(1 for k, _ in log if k == "elapsed")
    assert timed > 0 and s["io_wait_seconds"] >= 1e-3 * timed
    assert s["bytes_read"] == s["expert_loads"] * rt.expert_bytes  # the host tier's copies are counted too
