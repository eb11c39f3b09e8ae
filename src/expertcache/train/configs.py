"""The shipped model architectures and the training defaults, in one place.

Two real Hugging Face MoE architectures, sized to ship inside the package (<= 16 MB in bf16) and to train on a
2-core CPU in about an hour. Both have the same width, depth, total and *active* expert parameters, so they differ
only in expert granularity:

- ``granular``: OLMoE (``OlmoeForCausalLM``), 32 experts of width 104 per layer, top-8 (fine-grained experts);
- ``coarse``:   Mixtral (``MixtralForCausalLM``), 8 experts of width 416 per layer, top-2;
- ``tiny``:     a 2-layer OLMoE debug config for tests (seconds to train);
- ``granular-256``: OLMoE 4 × 256, 16 experts of width 256, top-4, **untied** lm_head: not shipped (~36 MB in
  bf16); every matrix row is a multiple of 256 so llama.cpp's K-quants (Q4_K_M) can quantise it, for the
  like-for-like quality comparison in ``benchmarks/bench_llama_quality.py``.

Letter legend used in names across ``expertcache.train``: B batch, T tokens per sequence, V vocab, E experts,
K experts per token, L layers, D hidden width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one model. ``arch`` is ``"olmoe"`` or ``"mixtral"``; ``ffn`` is the width of one expert;
    ``tied``: the lm_head shares the embedding matrix."""

    arch: str
    hidden: int
    layers: int
    heads: int
    experts: int
    top_k: int
    ffn: int
    router_aux_loss_coef: float = 0.01
    tied: bool = True


MODEL_SPECS: dict[str, ModelSpec] = {
    "granular": ModelSpec("olmoe", hidden=144, layers=4, heads=4, experts=32, top_k=8, ffn=104),
    "coarse": ModelSpec("mixtral", hidden=144, layers=4, heads=4, experts=8, top_k=2, ffn=416),
    "tiny": ModelSpec("olmoe", hidden=32, layers=2, heads=2, experts=8, top_k=2, ffn=16),
    "granular-256": ModelSpec("olmoe", hidden=256, layers=4, heads=4, experts=16, top_k=4, ffn=256, tied=False),
}


@dataclass
class TrainConfig:
    """Every training default. The ``expertcache train`` flags are generated from these fields.

    One step sees ``batch_size * seq_len`` tokens. The learning rate warms up linearly for ``warmup_steps`` and then
    follows a cosine from ``lr`` down to ``lr * min_lr_ratio`` at ``steps``. Training is in fp32; the exported weights
    are cast to ``save_dtype``. ``data_dir=""`` means: ``$EXPERTCACHE_DATA/corpus-debian-docs`` if that variable is
    set, else ``../shared/data/corpus-debian-docs`` relative to the repository.
    """

    model: str = "granular"
    out: str = ""  # run directory; "" = runs/<model>
    data_dir: str = ""
    seed: int = 0
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 200
    eval_tokens: int = 32768  # held-out tokens scored at each eval during training
    ckpt_every: int = 100
    threads: int = 1
    # fwd+bwd+AdamW tokens/s, 1 thread, B=8 T=256, OLMoE d160 L4 E32 K4: grouped_mm 2088, eager 1707, batched_mm 84
    experts_implementation: str = "grouped_mm"
    save_dtype: str = "bfloat16"
    max_docs: int = 0  # 0 = all documents; >0 keeps the first N (tests)

    def __post_init__(self) -> None:
        if self.model not in MODEL_SPECS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {sorted(MODEL_SPECS)}")
        self.check_training_fields()

    def check_training_fields(self) -> None:
        """Validate the fields every training run shares (dtype, sizes, intervals); ValueError otherwise."""
        check_save_dtype(self.save_dtype)
        if isinstance(self.seq_len, int) and self.seq_len == 1:  # 0 and negatives: check_positive's message
            raise ValueError("--seq-len must be ≥ 2 (a sequence's tokens predict the next ones), got 1")
        check_positive(self, ("seq_len", "batch_size", "steps", "vocab_size", "ckpt_every", "log_every", "eval_every"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_positive(cfg, names, *, flags: bool = False) -> None:
    """ValueError naming the first field of ``names`` whose value on ``cfg`` is below 1 (named as its
    ``--flag`` with ``flags``: for configs whose fields are command-line flags)."""
    for name in names:
        if getattr(cfg, name) < 1:
            label = "--" + name.replace("_", "-") if flags else name
            raise ValueError(f"{label} must be ≥ 1, got {getattr(cfg, name)}")


def check_save_dtype(value: str, label: str = "save_dtype") -> None:
    if value not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{label} must be float32, bfloat16 or float16, got {value!r}")


def build_hf_config(spec: ModelSpec, vocab_size: int, seq_len: int, bos_id: int, eos_id: int, pad_id: int,
                    experts_implementation: str = "grouped_mm"):
    """Return the transformers config (``OlmoeConfig`` or ``MixtralConfig``) for ``spec``, embeddings tied as
    ``spec.tied`` says,
    ``output_router_logits=True`` so the forward adds the model's own load-balancing loss."""
    from transformers import MixtralConfig, OlmoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads, max_position_embeddings=seq_len,
        tie_word_embeddings=spec.tied, num_experts_per_tok=spec.top_k, output_router_logits=True,
        router_aux_loss_coef=spec.router_aux_loss_coef, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        use_cache=True,
    )
    if spec.arch == "olmoe":
        cfg = OlmoeConfig(num_experts=spec.experts, norm_topk_prob=False, **common)
    elif spec.arch == "mixtral":
        cfg = MixtralConfig(num_local_experts=spec.experts, **common)
    else:
        raise ValueError(f"unknown arch {spec.arch!r}")
    cfg._experts_implementation = experts_implementation
    return cfg


def build_model(cfg):
    """Fresh, randomly initialised ``OlmoeForCausalLM`` / ``MixtralForCausalLM`` for a transformers config."""
    from transformers import MixtralForCausalLM, OlmoeForCausalLM

    cls = OlmoeForCausalLM if cfg.model_type == "olmoe" else MixtralForCausalLM
    return cls(cfg)


def count_params(model) -> tuple[int, int]:
    """(total, experts) parameter counts; tied embeddings are counted once."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, experts
