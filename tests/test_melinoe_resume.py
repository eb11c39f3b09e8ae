"""A resumed ``melinoe finetune`` is exactly the uninterrupted run (issue 27: from its first resumed step it differed,
held-out perplexity 75.05 vs 74.15, because the resumed run took L_rm's base routers from the tuned checkpoint).
Like ``train``'s resume test: the same steps, the same losses, the same trainable tensors, bit for bit."""

import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_melinoe import _ft_cfg, _write_corpus  # noqa: E402


def test_resumed_finetune_equals_the_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    from expertcache.melinoe.finetune import finetune

    torch.set_num_threads(1)
    _write_corpus(tmp_path / "corpus")
    finetune(_ft_cfg(tmp_path, "whole", 3), progress=False, stop_at=3)  # no export: compare the training state
    finetune(_ft_cfg(tmp_path, "resumed", 3), progress=False, stop_at=1)
    finetune(_ft_cfg(tmp_path, "resumed", 3), progress=False, stop_at=3)

    def rows(name):
        return [{k: v for k, v in r.items() if k != "elapsed_s"}
                for r in json.loads((tmp_path / name / "state" / "state.json").read_text())["rows"]]

    assert rows("resumed") == rows("whole")  # losses of steps 2 and 3 (L_rm included) as uninterrupted
    a = load_file(str(tmp_path / "whole" / "state" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "state" / "trainable.safetensors"))
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
