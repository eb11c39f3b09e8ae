"""Nothing expertcache loads can run code: planted pickles are refused (exit 2, file named) and never unpickled."""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "expertcache"


class _Plant:
    """Unpickling this object creates ``marker`` (what an attacker's payload would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _torch_pickle(path: Path, marker: Path) -> None:
    import torch

    torch.save({"model": _Plant(marker), "step": 3}, path)
    # sanity: the plant really would run on an unsafe load
    check = marker.with_name("sanity")
    torch.save(_Plant(check), path.with_name("probe.pt"))
    torch.load(path.with_name("probe.pt"), weights_only=False)
    assert check.exists()
    check.unlink()
    path.with_name("probe.pt").unlink()


def _run_cli(argv, capsys):
    from expertcache.cli.main import main

    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_train_refuses_a_planted_pickle_checkpoint(tmp_path, capsys):
    pytest.importorskip("transformers")
    out, marker = tmp_path / "run", tmp_path / "PWNED"
    out.mkdir()
    _torch_pickle(out / "ckpt.pt", marker)
    code, err = _run_cli(["train", "--model", "tiny", "--out", str(out), "--data-dir", str(tmp_path / "no-data"),
                          "--no-progress"], capsys)
    assert code == 2
    assert not marker.exists(), "the planted checkpoint was unpickled"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "ckpt.pt" in lines[0] and "pickle" in lines[0] and "Traceback" not in err


def test_a_planted_or_corrupt_safetensors_checkpoint_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file
    import torch

    from expertcache.train.loop import load_train_state

    bad = tmp_path / "ckpt.safetensors"
    bad.write_bytes(pickle.dumps(_Plant(tmp_path / "PWNED")))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_train_state(bad)
    assert not (tmp_path / "PWNED").exists()
    save_file({"x": torch.zeros(2)}, str(bad))  # a valid safetensors file that is no training state
    with pytest.raises(ValueError, match="not an expertcache training checkpoint"):
        load_train_state(bad)


def test_training_state_round_trips_without_pickle(tmp_path):
    """Model and AdamW tensors, the optimizer's hyper-parameters and all three RNG states come back exactly."""
    import random

    import torch

    from expertcache.train.loop import _rng_state, _set_rng_state, load_train_state, save_train_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight = torch.nn.Parameter(model[0].weight[:2])  # shared storage (like tied embeddings)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    np.random.seed(5)
    random.seed(6)
    rng = _rng_state()
    path = tmp_path / "ckpt.safetensors"
    save_train_state(path, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=rng,
                     info={"step": 7, "log": [{"step": 7, "loss": 1.5}], "config": {"a": 1}, "elapsed_s": 2.5})
    assert path.read_bytes()[:2] != b"\x80\x04" and not path.read_bytes().startswith(b"PK")  # not pickle / zip
    expected = (torch.rand(3), np.random.rand(3), random.random())
    ms, os_, rng2, info = load_train_state(path)
    assert info == {"step": 7, "log": [{"step": 7, "loss": 1.5}], "config": {"a": 1}, "elapsed_s": 2.5}
    assert ms.keys() == model.state_dict().keys()
    assert all(torch.equal(ms[k], v) for k, v in model.state_dict().items())
    ref = opt.state_dict()
    assert os_["param_groups"] == ref["param_groups"]
    assert os_["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        assert entry.keys() == os_["state"][i].keys()
        assert all(torch.equal(entry[k], os_["state"][i][k]) for k in entry)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt2.load_state_dict(os_)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95) and opt2.param_groups[0]["lr"] == 1e-2
    _set_rng_state(rng2)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_token_arrays_are_never_unpickled(tmp_path):
    """A run folder whose cached token stream is a pickled object array: clear error naming it, no code run."""
    pytest.importorskip("transformers")
    from expertcache.assets import shipped_model_dir
    from expertcache.train.configs import TrainConfig
    from expertcache.train.loop import prepare_data

    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_dir("granular") / name, run / "tokenizer" / name)
    (run / "data").mkdir()
    marker = tmp_path / "PWNED"
    np.save(run / "data" / "train.npy", np.array([_Plant(marker)], dtype=object), allow_pickle=True)
    np.save(run / "data" / "heldout.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match=re.escape(str(run / "data" / "train.npy"))):
        prepare_data(TrainConfig(model="tiny", out=str(run)), run)
    assert not marker.exists()


def test_profiles_are_never_unpickled(tmp_path):
    from expertcache.analysis.profile import load_profile

    marker = tmp_path / "PWNED"
    path = tmp_path / "freq.npy"
    np.save(path, np.array([_Plant(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_profile(path)
    assert not marker.exists()


def test_no_unsafe_loader_in_the_source():
    """Static guard: no pickle-based load anywhere in the package."""
    unsafe = re.compile(r"weights_only\s*=\s*False|allow_pickle\s*=\s*True|\bpickle\.loads?\(|\bimport pickle\b"
                        r"|torch\.load\((?![^)]*weights_only\s*=\s*True)|\bjoblib\b|\bdill\b|\bmarshal\.loads?\(")
    hits = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if unsafe.search(line)]
    assert not hits, hits
