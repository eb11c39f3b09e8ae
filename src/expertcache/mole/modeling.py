"""Mixture of Lookup Experts (MoLE, seed 002) as a Hugging Face model, built from transformers' Llama blocks.

One MoLE layer (training form), with pre-norm like every sub-block of the trunk::

    x  = RMSNorm(h)                                  # h: residual stream after attention
    g  = softmax(router(x))                          # [N], all N experts active, no top-k, no auxiliary loss
    h' = h + FFN_shared(x) + sum_j g_j * FFN_j(RMSNorm_e(e))      # e = Embedding(token id)

The routed experts only ever see the token's embedding, so ``FFN_j(RMSNorm_e(Embedding(v)))`` is a function of the
token id ``v`` alone: after training it is precomputed into a lookup table ``LUT_l[v, j]`` (``mole.table``) and the
routed expert weights are never loaded again. Both forms share this code; they differ in where the per-layer routed
outputs ``y[U, N, D]`` of the U distinct token ids of a forward come from:

- training form (``config.lookup_table is None``): ``layer.mlp.experts(layer.mlp.expert_norm(Embedding(ids_U)))``,
  computed once per distinct id (the same value for every position holding it, so also the same gradient);
- table form (``config.lookup_table`` set by ``expertcache mole export``): rows ``[U, L, N, D]`` read from the table
  file by a :class:`~expertcache.mole.table.LookupTable` attached with :func:`load_table_model`. Such a model has no
  ``expert_norm``/``experts`` modules at all.

Letter legend: B batch, T tokens, U distinct ids, V vocab, L layers, N routed experts, D hidden, F expert width.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from expertcache.models.cachearg import cache_kw, out_cache
from expertcache.mole.table import LookupTable


@strict
class MoleConfig(LlamaConfig):
    """``LlamaConfig`` plus the MoLE fields. ``intermediate_size`` is the shared expert's width.

    ``lookup_table`` is ``None`` for the training form; the table form's config (written by the exporter) holds the
    table's description (see :mod:`expertcache.mole.table`).
    """

    model_type = "expertcache_mole"
    num_experts: int = 4
    expert_intermediate_size: int = 384
    lookup_table: dict | None = None


class RoutedExperts(nn.Module):
    """N SwiGLU experts, weights stacked like transformers' Mixtral experts: ``gate_up_proj [N, 2F, D]`` (gate rows
    first), ``down_proj [N, D, F]``. Every input row goes through every expert."""

    def __init__(self, config: MoleConfig):
        super().__init__()
        n, f, d = config.num_experts, config.expert_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_dim = n, f
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(n, d, f))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x_UD: torch.Tensor) -> torch.Tensor:
        """``x [U, D]`` -> ``y [U, N, D]`` with ``y[u, j] = FFN_j(x[u])``."""
        n, f = self.num_experts, self.intermediate_dim
        h_UN2F = (x_UD @ self.gate_up_proj.reshape(n * 2 * f, -1).T).view(-1, n, 2 * f)  # one matmul for all N
        gate_UNF, up_UNF = h_UN2F.split(f, dim=-1)
        a_NUF = (self.act_fn(gate_UNF) * up_UNF).transpose(0, 1)
        y_NUD = torch.bmm(a_NUF, self.down_proj.transpose(1, 2))  # [N, U, F] @ [N, F, D]
        return y_NUD.transpose(0, 1)


class MoleFFN(nn.Module):
    """The feed-forward half of a MoLE layer: router + shared expert (+ routed experts in the training form)."""

    def __init__(self, config: MoleConfig):
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.shared_expert = LlamaMLP(config)
        if config.lookup_table is None:
            self.expert_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.experts = RoutedExperts(config)

    def routed_outputs(self, e_UD: torch.Tensor) -> torch.Tensor:
        """Training form only: ``y [U, N, D] = FFN_j(RMSNorm_e(e))`` -- exactly what the table stores per id."""
        return self.experts(self.expert_norm(e_UD))

    def forward(self, x_BTD: torch.Tensor, y_UND: torch.Tensor, inv_BT: torch.Tensor) -> torch.Tensor:
        """``FFN_shared(x) + sum_j g_j y[id, j]`` for normed hidden states ``x [B, T, D]``; ``inv [B, T]`` maps each
        position to its row of ``y``."""
        g_BTN = F.softmax(self.router(x_BTD), dim=-1, dtype=torch.float32).to(x_BTD.dtype)
        y_BTND = y_UND[inv_BT]
        routed_BTD = (g_BTN.unsqueeze(-2) @ y_BTND).squeeze(-2)  # [B, T, 1, N] @ [B, T, N, D]
        return self.shared_expert(x_BTD) + routed_BTD


class MoleDecoderLayer(nn.Module):
    """``LlamaDecoderLayer`` with its MLP replaced by :class:`MoleFFN`."""

    def __init__(self, config: MoleConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = MoleFFN(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h_BTD, y_UND, inv_BT, attention_mask=None, position_embeddings=None, past_key_values=None):
        a_BTD, _ = self.self_attn(hidden_states=self.input_layernorm(h_BTD), position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **cache_kw(past_key_values))
        h_BTD = h_BTD + a_BTD
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD), y_UND, inv_BT)


class MolePreTrainedModel(PreTrainedModel):
    config_class = MoleConfig
    config: MoleConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoleDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        PreTrainedModel._init_weights(self, module)
        if isinstance(module, RoutedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)


class MoleModel(MolePreTrainedModel):
    def __init__(self, config: MoleConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MoleDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.table = None  # table form: a LookupTable, attached by load_table_model (not a module, no weights)
        self.post_init()

    @property
    def is_table_form(self) -> bool:
        return self.config.lookup_table is not None

    def forward(self, input_ids: torch.LongTensor, attention_mask=None, position_ids=None,
                past_key_values: Cache | None = None, use_cache: bool | None = None, **kwargs):
        past_key_values = kwargs.pop("cache", None) if past_key_values is None else past_key_values  # 5.24's name
        if input_ids is None:
            raise ValueError("MoLE needs input_ids: its routed experts are indexed by token id")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        e_BTD = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=e_BTD, attention_mask=attention_mask,
                                  **cache_kw(past_key_values), position_ids=position_ids)
        pos = self.rotary_emb(e_BTD, position_ids=position_ids)

        ids_U, inv_BT = torch.unique(input_ids, return_inverse=True)
        if self.is_table_form:
            if self.table is None:
                raise RuntimeError("table-form MoLE model without a table: load it with load_table_model(dir)")
            y_LUND = self.table.lookup(ids_U, positions=input_ids.numel()).to(e_BTD.device, e_BTD.dtype)  # all layers' rows of each distinct id, one read
        else:
            e_UD = self.embed_tokens(ids_U)
        h_BTD = e_BTD
        for l, layer in enumerate(self.layers):
            y_UND = y_LUND[:, l] if self.is_table_form else layer.mlp.routed_outputs(e_UD)
            h_BTD = layer(h_BTD, y_UND, inv_BT, attention_mask=mask, position_embeddings=pos,
                          past_key_values=past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h_BTD), **cache_kw(past_key_values))


class MoleForCausalLM(MolePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MoleConfig):
        super().__init__(config)
        self.model = MoleModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor = None, attention_mask=None, position_ids=None,
                past_key_values: Cache | None = None, use_cache: bool | None = None, logits_to_keep: int = 0,
                labels=None, **kwargs) -> CausalLMOutputWithPast:
        """Like ``LlamaForCausalLM.forward``; extra keyword arguments (``output_router_logits`` ...) are ignored."""
        past_key_values = kwargs.pop("cache", None) if past_key_values is None else past_key_values  # 5.24's name
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache)
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_kw(out_cache(out)))


def load_table_model(table_dir: str | Path, read_mode: str = "mmap", dtype: torch.dtype = torch.float32):
    """The table form saved by ``expertcache mole export``: trunk weights from ``table_dir`` (no routed expert
    weights exist there) plus its lookup table opened with ``read_mode`` (see :class:`~expertcache.mole.table.
    LookupTable`). Returns the model in eval mode."""
    table_dir = Path(table_dir)
    model = MoleForCausalLM.from_pretrained(str(table_dir), dtype=dtype)
    if model.config.lookup_table is None:
        raise ValueError(f"{table_dir} is a training-form MoLE model; export it with `expertcache mole export`")
    model.model.table = LookupTable.open(table_dir, read_mode)
    return model.eval()


def register_auto() -> None:
    """Let ``AutoConfig``/``AutoModelForCausalLM.from_pretrained`` open MoLE folders (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register(MoleConfig.model_type, MoleConfig)
        AutoModelForCausalLM.register(MoleConfig, MoleForCausalLM)
    except ValueError:  # already registered
        pass


register_auto()
