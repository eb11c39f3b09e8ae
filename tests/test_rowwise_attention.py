"""Row-wise decode attention (serve/attention.py) against each row decoded alone, bit for bit.

The independent computation is the model's own sdpa attention on a lone row (no batch, no padding, no mask):
a left-padded batch of rows of different lengths, decoded one step with the row-wise function, must give
every row exactly the logits that row gets alone -- the property the serving engine's "alone equals batched"
promise rests on (bfloat16, where the fused kernel's blocking would otherwise change the sums).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from expertcache.models.loader import resolve_model_path
from expertcache.serve.attention import install_rowwise_attention
from expertcache.serve.kv import BatchKV

# lengths on both sides of the CPU kernel's key blocks, so that the padding moves the real keys' block boundaries
PROMPTS = [[(7 * i * i + 13 * i + 5) % 8000 + 3 for i in range(n)] for n in (150, 2, 37, 95)]


@pytest.fixture(scope="module")
def models():
    path = resolve_model_path("granular")
    alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    rowwise = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    install_rowwise_attention(rowwise)
    return alone, rowwise


def _prefill(model, ids):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=model.config), use_cache=True)
    return out.logits[0, -1], out.past_key_values


@pytest.mark.parametrize("steps", [1, 3])
def test_padded_batch_rows_equal_each_row_alone(models, steps):
    alone, rowwise = models
    kv = BatchKV()
    lone = []
    for ids in PROMPTS:
        logits, past = _prefill(alone, ids)
        lone.append([past, int(logits.argmax())])
        _, row_past = _prefill(rowwise, ids)
        kv.add(row_past)
    assert kv.padded
    nxt = [t for _, t in lone]
    for _ in range(steps):
        mask = kv.step_mask()
        pos = (mask.sum(dim=1, keepdim=True) - 1)
        with torch.inference_mode():
            out = rowwise(input_ids=torch.tensor([[t] for t in nxt]), past_key_values=kv.cache, use_cache=True,
                          attention_mask=mask, position_ids=pos)
        kv.cache = out.past_key_values
        for b, row in enumerate(lone):
            with torch.inference_mode():
                ref = alone(input_ids=torch.tensor([[nxt[b]]]), past_key_values=row[0], use_cache=True)
            row[0] = ref.past_key_values
            assert torch.equal(out.logits[b, -1], ref.logits[0, -1]), f"row {b} (prompt of {len(PROMPTS[b])} tokens)"
        nxt = [int(out.logits[b, -1].argmax()) for b in range(len(PROMPTS))]
