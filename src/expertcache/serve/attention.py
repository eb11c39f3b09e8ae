"""Row-wise decode attention: each row of a left-padded batch attends exactly as it would alone.

Why: with left padding, a row's keys sit behind ``L - L_b`` masked columns. The masked columns add exact
zeros, but the fused CPU attention kernels block the key axis, so the padding shifts the block boundaries and
changes the summation order of the real keys: in bfloat16 the attention output of a padded row differs from
the same row alone (measured on the shipped granular model: up to 1.6e-2 after ``o_proj`` in layer 0, enough
to flip a greedy token within 8 steps). Every other op of a decode step is row-invariant in bfloat16 on CPU
(linears of M = 1..40 rows give bit-identical rows; norms, rotary, router, the runtime's per-expert combine in
ascending id are per row).

Packed prefill: several new prompts prefilled in one forward, concatenated into one row (position ids
restart per prompt, :func:`packed_segments` names the lengths): attention runs per prompt on its own
query/key/value columns with no mask, as that prompt's lone prefill does, so the prompts share the expert
loads of one MoE step per layer while each computes what it would alone.

So for a *batched decode step* (B > 1 rows, one query token each, a padding mask) this attention function
slices each row's real key/value columns (``[1, H, L_b, d]``: the last L_b, a view) and calls
the model's own attention function (sdpa or eager) on that row with no mask, as the lone decode does. Every
other call (prefill, batch 1, no mask) goes straight to the model's own function. B small calls per layer cost
little next to the expert reads; the rest of the step (projections, router, experts, lm_head) stays batched.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["install_rowwise_attention", "packed_segments", "ROWWISE"]

ROWWISE = "expertcache_rowwise"
_state = threading.local()


@contextlib.contextmanager
def packed_segments(lengths: list[int]):
    """Within this block a one-row forward over a fresh cache is several prompts packed end to end
    (``lengths`` tokens each): attention runs per segment, each exactly as that prompt alone."""
    _state.segments = list(lengths)
    try:
        yield
    finally:
        _state.segments = None


def _make(base_name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS[base_name]

    def rowwise(module, query_BHqd, key_BHLd, value_BHLd, attention_mask, **kwargs):
        B, _, q, _ = query_BHqd.shape
        segs = getattr(_state, "segments", None)
        if segs and B == 1 and q == sum(segs) == key_BHLd.shape[2]:  # packed prefill: one prompt at a time
            outs, a = [], 0
            for n in segs:
                out_1nHd, _ = base(module, query_BHqd[:, :, a:a + n], key_BHLd[:, :, a:a + n].contiguous(),
                                   value_BHLd[:, :, a:a + n].contiguous(), None, **kwargs)
                outs.append(out_1nHd)
                a += n
            return torch.cat(outs, dim=1), None
        if attention_mask is None or B == 1 or q != 1:
            return base(module, query_BHqd, key_BHLd, value_BHLd, attention_mask, **kwargs)
        # left padding (serve/kv.py): a row's real columns are its last L_b; one host transfer for all rows, made
        # by the first layer of the forward (every layer gets the same mask object)
        kept = getattr(_state, "starts", None)
        if kept is not None and kept[0] is attention_mask:
            starts = kept[1]
        else:
            m_BL = attention_mask[:, 0, -1]  # sdpa masks are bool (True = attend); additive ones are 0 where kept
            keep_BL = m_BL if m_BL.dtype == torch.bool else m_BL == 0
            starts = (keep_BL.shape[1] - keep_BL.sum(dim=1)).tolist()
            _state.starts = (attention_mask, starts)
        outs = []
        for b, a in enumerate(starts):
            out_1qHd, _ = base(module, query_BHqd[b:b + 1], key_BHLd[b:b + 1, :, a:], value_BHLd[b:b + 1, :, a:],
                               None, **kwargs)
            outs.append(out_1qHd)
        return torch.cat(outs, dim=0), None

    return rowwise


def install_rowwise_attention(model) -> str:
    """Make ``model`` use row-wise decode attention around its current implementation (sdpa). Returns the
    previous implementation name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prev = model.config._attn_implementation
    if prev == ROWWISE:
        return prev
    if prev != "sdpa":
        raise NotImplementedError(f"row-wise attention wraps sdpa; the model uses {prev!r}")
    ALL_ATTENTION_FUNCTIONS.register(ROWWISE, _make(prev))
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROWWISE, ALL_MASK_ATTENTION_FUNCTIONS[prev])
    model.set_attn_implementation(ROWWISE)
    return prev
