"""The three model kinds compared in ``docs/MOLE.md`` and their training defaults, in one place.

All kinds share one trunk (Llama blocks: RoPE attention, RMSNorm, SwiGLU, tied embeddings) and differ only in the
feed-forward part of each layer:

- ``dense``: one SwiGLU FFN of width ``ffn`` (``LlamaForCausalLM``);
- ``moe``:   ``experts`` SwiGLU experts of width ``ffn // top_k``, top-``top_k`` routing (``MixtralForCausalLM``,
  whose attention is Llama's): the active expert parameters equal the dense FFN's;
- ``mole``:  a shared SwiGLU FFN of width ``ffn`` on the hidden state plus ``experts`` routed SwiGLU experts of width
  ``expert_ffn`` on the token's embedding, all active, gates = softmax over all N (:mod:`expertcache.mole.modeling`).
  At inference the routed experts are a lookup table, so the compute per token equals the dense model's plus a
  ``D x N`` router.

Letter legend used across ``expertcache.mole``: B batch, T tokens per sequence, U distinct token ids in one forward,
V vocab, L layers, N routed experts, D hidden width, F expert width, R bytes of one table record.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertcache.train.configs import TrainConfig, check_positive

KINDS = ("dense", "moe", "mole")


@dataclass
class MoleTrainConfig(TrainConfig):
    """:class:`~expertcache.train.configs.TrainConfig` plus the architecture of one compared model.

    ``model`` is only a label here (``dense``, ``moe-16``, ``mole-4`` ...; set from ``kind``/``experts`` when
    empty). ``experts``: routed experts N for ``mole``, experts E for ``moe``. ``top_k`` is used by ``moe`` only,
    ``expert_ffn`` (0 = ``ffn``) by ``mole`` only. Weights are exported in float32 so the table export starts from
    the trained values.
    """

    model: str = ""
    kind: str = "mole"
    experts: int = 4
    top_k: int = 4
    hidden: int = 144
    layers: int = 4
    heads: int = 4
    ffn: int = 384
    expert_ffn: int = 0
    router_aux_loss_coef: float = 0.01  # moe only; mole and dense have no auxiliary loss
    save_dtype: str = "float32"
    experts_implementation: str = "grouped_mm"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; choose one of {KINDS}")
        if self.kind != "dense" and self.experts < 1:
            raise ValueError(f"experts must be >= 1, got {self.experts}")
        if self.kind == "moe":
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")
            if self.ffn % self.top_k:
                raise ValueError(f"ffn={self.ffn} must be divisible by top_k={self.top_k} (matched active params)")
        if not self.model:
            self.model = self.kind if self.kind == "dense" else f"{self.kind}-{self.experts}"
        check_positive(self, ("hidden", "layers", "heads", "ffn"))
        self.check_training_fields()

    def spec(self) -> dict:
        """The architecture fields (what :func:`build_model` reads)."""
        keys = {"dense": (), "moe": ("experts", "top_k", "router_aux_loss_coef"), "mole": ("experts", "expert_ffn")}
        spec = {k: getattr(self, k) for k in ("kind", "hidden", "layers", "heads", "ffn", *keys[self.kind])}
        if self.kind == "moe":
            spec["expert_width"] = self.ffn // self.top_k
        if self.kind == "mole":
            spec["expert_ffn"] = self.expert_ffn or self.ffn
        return spec


def build_config(cfg: MoleTrainConfig, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    """The transformers config of ``cfg``: ``LlamaConfig`` (dense), ``MixtralConfig`` (moe) or ``MoleConfig``."""
    from transformers import LlamaConfig, MixtralConfig

    from expertcache.mole.modeling import MoleConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq_len, tie_word_embeddings=True,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True, rms_norm_eps=1e-5,
    )
    if cfg.kind == "dense":
        return LlamaConfig(intermediate_size=cfg.ffn, **common)
    if cfg.kind == "moe":
        hf = MixtralConfig(intermediate_size=cfg.ffn // cfg.top_k, num_local_experts=cfg.experts,
                           num_experts_per_tok=cfg.top_k, output_router_logits=True,
                           router_aux_loss_coef=cfg.router_aux_loss_coef, **common)
        hf._experts_implementation = cfg.experts_implementation
        return hf
    return MoleConfig(intermediate_size=cfg.ffn, num_experts=cfg.experts, expert_intermediate_size=cfg.expert_ffn or cfg.ffn,
                      **common)


def build_model(cfg: MoleTrainConfig, tok):
    """The ``builder`` handed to :func:`expertcache.train.loop.train`: (fresh model, spec dict)."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    from expertcache.mole.modeling import MoleForCausalLM

    hf = build_config(cfg, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    cls = {"dense": LlamaForCausalLM, "moe": MixtralForCausalLM, "mole": MoleForCausalLM}[cfg.kind]
    return cls(hf), cfg.spec()


def tiny(kind: str, **overrides) -> MoleTrainConfig:
    """A debug config (seconds to train) used by the tests."""
    base = dict(kind=kind, experts=4, top_k=2, hidden=32, layers=2, heads=2, ffn=32, vocab_size=300, seq_len=32,
                batch_size=4, steps=6, lr=1e-2, warmup_steps=2, log_every=1, eval_every=6, ckpt_every=3,
                eval_tokens=512, experts_implementation="eager")
    base.update(overrides)
    return MoleTrainConfig(**base)
