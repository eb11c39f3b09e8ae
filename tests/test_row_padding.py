"""Row padding (offload/experts.py: ``bucket_rows``) in bfloat16 on a CPU for **every** registered family.

Padding happens only for bf16/fp16 on a CPU; the tiny test models are float32 and ``test_row_buckets.py`` runs
the one shipped bf16 model (an OLMoE-layout one), so GPT-OSS's interleaved expert MLP and the other families'
padded products ran in no test (issue 36: GPT-OSS slicing its padded rows from the end survived). Here every
tiny family is loaded in bf16 and its multi-row prefill logits must equal, bit for bit, the same forward with
the padding switched off (``row_bucket`` the identity: no row added, nothing sliced), and stay within bf16's
rounding of the stock transformers model in bf16 (an implementation we do not write).
"""

from __future__ import annotations

import pytest
import torch

from expertcache.models import SUPPORTED_MODEL_TYPES, load_model
from expertcache.models.tiny import save_tiny
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload import experts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

#: prompt lengths: each expert then sees row counts that are not powers of two (padded) as well as ones that are
LENGTHS = (3, 11, 37)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bf16")
    return {a: save_tiny(a, root / a, seed=6) for a in SUPPORTED_MODEL_TYPES}


def _ids(n: int) -> torch.Tensor:
    return torch.tensor([[(29 * i * i + 7 * i + 5) % 120 + 3 for i in range(n)]])


def _prefills(model) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(_ids(n), use_cache=False).logits.float() for n in LENGTHS]


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_padding_keeps_every_familys_bf16_logits(tiny_dir, arch, monkeypatch):
    """Padded == unpadded bit for bit, and both near the stock bf16 model. Fails for gpt_oss on experts.py's
    interleaved MLP returning ``out[-m:]`` (its padded rows, from the end) instead of ``out[:m]``, and for every
    other family on the linear MLP's ``out[:m]`` → ``out[-m:]``."""
    rt = OffloadedModel.from_pretrained(tiny_dir[arch], OffloadConfig(tier="host", capacity=4), dtype=torch.bfloat16)
    assert rt.dtype == torch.bfloat16
    padded_rows = []
    bucket = experts.bucket_rows

    def spy(x_MD):
        out, m = bucket(x_MD)
        padded_rows.append(out.shape[0] - m)
        return out, m

    monkeypatch.setattr(experts, "bucket_rows", spy)
    padded = _prefills(rt.model)
    monkeypatch.undo()
    assert any(padded_rows), f"{arch}: no product was padded -- the test checks nothing"
    monkeypatch.setattr(experts, "row_bucket", lambda m: m)
    plain = _prefills(rt.model)
    monkeypatch.undo()
    for n, a, b in zip(LENGTHS, padded, plain):
        assert torch.equal(a, b), (arch, n, (a - b).abs().max().item())
    stock = _prefills(load_model(tiny_dir[arch], dtype=torch.bfloat16))
    for n, a, s in zip(LENGTHS, padded, stock):
        scale = s.abs().max().item()
        assert (a - s).abs().max().item() <= 0.05 * scale, (arch, n)  # bf16 rounding, not a wrong row
    rt.close()
