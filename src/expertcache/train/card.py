"""Evaluate a trained model folder and write its ``MODEL_CARD.md`` (and the same figures as ``card.json``).

Every figure is computed here from the folder's own weights and tokenizer (bf16 weights upcast to fp32):

- held-out perplexity: the held-out split of the training corpus, docs joined with eos, cut into non-overlapping
  ``seq_len``-token chunks, each scored from scratch (first token of a chunk = context only);
- unigram perplexity of exactly the same target tokens under the same tokenizer, (a) with token frequencies of the
  training split (add-one smoothed) and (b) fitted on those held-out tokens themselves (the best any unigram can do);
- WikiText-2 test perplexity: ``wiki.test.raw`` tokenized as one text, same chunking;
- expert load per layer: share of top-k selections per expert over the held-out tokens (min / max / normalised
  entropy H/log E, 1 = perfectly balanced);
- cache behaviour: top-k ids per token ``[T, L, K]`` (descending router weight) of ``cache_tokens`` held-out
  tokens (the first ``cache_tokens / P`` tokens of each of the P source packages' held-out text), in text order, replayed with :func:`expertcache.sim.replay` through one cache per layer
  (LRU and Belady) at C = N/2 and C = N/4, cache kept across chunks.
"""

from __future__ import annotations

import json
import math
import os
import platform
import string
from pathlib import Path

import numpy as np
import torch

from expertcache import __version__
from expertcache.jsonsafe import load_path
from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents

OPENING_SOURCES = ("linux-doc-6.1", "python3.11-doc", "perl-doc")  # first held-out document of each
OPENING_TOKENS = 64  # prompt length and greedy continuation length


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:  # closed: PYTHONWARNINGS=error turned the unclosed file into noise
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@torch.no_grad()
def score_stream(model, stream_N: np.ndarray, seq_len: int, top_k: int, batch_size: int = 16,
                 keep_ids_tokens: int = 0):
    """Score ``stream_N`` in non-overlapping chunks. Returns (nll per target ``[M]`` float64, targets ``[M]``,
    selection counts ``[L, E]``, ids ``[T, L, K]`` of the first ``keep_ids_tokens`` tokens in text order)."""
    n = (len(stream_N) // seq_len) * seq_len
    chunks_CT = torch.from_numpy(stream_N[:n].astype(np.int64)).view(-1, seq_len)
    nll, targets, counts_LE, ids = [], [], None, []
    kept = 0
    for i in range(0, len(chunks_CT), batch_size):
        x_BT = chunks_CT[i : i + batch_size]
        out = model(input_ids=x_BT, output_router_logits=True, use_cache=False)
        logp_BTV = torch.log_softmax(out.logits.float(), dim=-1)
        nll.append(-logp_BTV[:, :-1].gather(-1, x_BT[:, 1:, None])[..., 0].reshape(-1).double().numpy())
        targets.append(x_BT[:, 1:].reshape(-1).numpy())
        topk_LNK = torch.stack([torch.topk(r.float(), top_k, dim=-1).indices for r in out.router_logits])
        E = out.router_logits[0].shape[-1]
        c = torch.stack([torch.bincount(t.reshape(-1), minlength=E) for t in topk_LNK]).numpy()
        counts_LE = c if counts_LE is None else counts_LE + c
        if kept < keep_ids_tokens:
            take = min(keep_ids_tokens - kept, topk_LNK.shape[1])
            ids.append(topk_LNK[:, :take].permute(1, 0, 2).numpy())  # [N, L, K], rows in text order
            kept += take
    ids_TLK = np.concatenate(ids) if ids else np.zeros((0, len(counts_LE), top_k), dtype=np.int64)
    return np.concatenate(nll), np.concatenate(targets), counts_LE, ids_TLK


def load_balance(counts_LE: np.ndarray) -> list[dict]:
    """Per layer: fraction of selections per expert (min, max) and normalised entropy H / log E."""
    rows = []
    for layer, c in enumerate(counts_LE):
        f = c / c.sum()
        h = -(f[f > 0] * np.log(f[f > 0])).sum() / math.log(len(f))
        rows.append({"layer": layer, "min_frac": float(f.min()), "max_frac": float(f.max()),
                     "uniform_frac": 1 / len(f), "norm_entropy": float(h)})
    return rows


def cache_figures(ids_TLK: np.ndarray, num_experts: int) -> list[dict]:
    """LRU and Belady replay of fixed selections at C = N/2 and N/4 (one row per policy and size)."""
    from expertcache.sim import replay

    rows = []
    for div in (2, 4):
        cap = num_experts // div
        for eviction in ("lru", "belady"):
            r = replay(ids_TLK, num_experts, cap, eviction=eviction).to_row()
            rows.append({"capacity": cap, "capacity_label": f"N/{div}", "eviction": eviction,
                         "miss_rate": r["miss_rate"], "mean_lifetime": r["mean_lifetime"],
                         "layer_miss_rates": r["layer_miss_rates"], "tokens": r["tokens"]})
    return rows


def evaluate_model_dir(model_dir: str | Path, data_dir: str | None = None, max_tokens: int = 0,
                       cache_tokens: int = 16384, threads: int = 1, progress: bool = True) -> dict:
    """All card figures for ``model_dir`` as one JSON-serialisable dict (see the module docstring)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 experts_implementation="grouped_mm").eval()
    cfg = model.config
    seq_len = cfg.max_position_embeddings
    top_k = cfg.num_experts_per_tok
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    corpus = resolve_data_dir(data_dir)
    train_docs, heldout_docs = split_documents(load_documents(corpus))
    eos = tok.eos_token_id
    heldout_N = encode_stream(tok, [d["text"] for d in heldout_docs], eos)
    if max_tokens:
        heldout_N = heldout_N[:max_tokens]
    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    log(f"card: scoring {len(heldout_N)} held-out tokens")
    nll_M, targets_M, counts_LE, _ = score_stream(model, heldout_N, seq_len, top_k)
    # cache trace: an equal slice of contiguous held-out text from each source package, in text order
    packages = sorted({d["source"].split(":", 1)[0] for d in heldout_docs})
    per_pkg = max(seq_len, (cache_tokens // len(packages)) // seq_len * seq_len)
    cache_N = np.concatenate([encode_stream(tok, [d["text"] for d in heldout_docs
                                                  if d["source"].split(":", 1)[0] == pkg], eos)[:per_pkg]
                              for pkg in packages])
    _, _, _, ids_TLK = score_stream(model, cache_N, seq_len, top_k, keep_ids_tokens=len(cache_N))

    train_N = encode_stream(tok, [d["text"] for d in train_docs], eos)
    V = len(tok)
    p_train_V = (np.bincount(train_N, minlength=V) + 1.0) / (len(train_N) + V)
    p_self_V = np.bincount(targets_M, minlength=V) / len(targets_M)
    uni_train = float(np.exp(-np.log(p_train_V[targets_M]).mean()))
    uni_self = float(np.exp(-np.log(p_self_V[targets_M]).mean()))
    ppl = float(np.exp(nll_M.mean()))

    wiki_path = corpus.parent / "wikitext-2-raw-v1" / "wiki.test.raw"
    wiki = None
    if wiki_path.exists():
        wiki_N = np.asarray(tok.backend_tokenizer.encode(wiki_path.read_text(encoding="utf-8"),
                                                         add_special_tokens=False).ids, dtype=np.int64)
        if max_tokens:
            wiki_N = wiki_N[:max_tokens]
        log(f"card: scoring {len(wiki_N)} WikiText-2 tokens")
        w_nll, w_t, _, _ = score_stream(model, wiki_N, seq_len, top_k)
        # path relative to the data folder: a card carries no path of the machine that wrote it
        wiki = {"path": "wikitext-2-raw-v1/wiki.test.raw", "ppl": float(np.exp(w_nll.mean())),
                "tokens_scored": int(len(w_t)),
                "chars": len(wiki_path.read_text(encoding="utf-8"))}

    continuations = []
    for src in OPENING_SOURCES:
        doc = next((d for d in heldout_docs if d["source"].startswith(src + ":")), None)
        if doc is None:
            continue
        prompt_ids = tok.backend_tokenizer.encode(doc["text"], add_special_tokens=False).ids[:OPENING_TOKENS]
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=OPENING_TOKENS, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=eos)
        continuations.append({"source": doc["source"], "prompt": tok.decode(prompt_ids),
                              "continuation": tok.decode(out[0, len(prompt_ids):].tolist())})

    summary_path = model_dir / "train_summary.json"
    train_summary = load_path(summary_path) if summary_path.exists() else {}
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "model_dir": str(model_dir), "arch": type(model).__name__, "expertcache": __version__,
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads, "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "num_experts": num_experts, "top_k": top_k, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "expert_ffn": cfg.intermediate_size, "heads": cfg.num_attention_heads, "seq_len": seq_len, "vocab": V,
        "params_total": total, "params_experts": experts, "experts_share": experts / total,
        "tied": bool(getattr(cfg, "tie_word_embeddings", True)),
        "weights_dtype": str(next(iter(_safetensors_dtypes(model_dir)), "unknown")),
        "heldout": {"docs": len(heldout_docs), "tokens_scored": int(len(targets_M)), "ppl": ppl,
                    "unigram_ppl_train_freqs": uni_train, "unigram_ppl_self_fit": uni_self,
                    "ratio_to_best_unigram": ppl / min(uni_train, uni_self)},
        "wikitext2": wiki, "load_balance": load_balance(counts_LE), "cache": cache_figures(ids_TLK, num_experts),
        "cache_tokens": int(len(ids_TLK)), "cache_packages": packages, "continuations": continuations, "train": train_summary,
    }


def _safetensors_dtypes(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def render_card(r: dict, command: str) -> str:
    """MODEL_CARD.md text from :func:`evaluate_model_dir`'s dict; ``command`` is the command that produced it.
    The prose is ``templates/MODEL_CARD.md`` (``string.Template``); the tables' rows are made here. The
    transformers version named is the one the card was made with (``r["transformers"]``), not the installed one,
    so a card renders the same under any later transformers."""
    import transformers

    t, h = r["train"], r["heldout"]
    tc, name = t.get("config", {}), Path(r["model_dir"]).name
    w = r["wikitext2"]
    cache_rows = [f"| {c['capacity']} ({c['capacity_label']}) | {c['eviction']} | {c['miss_rate']:.3f} | "
                  + ("–" if c["mean_lifetime"] is None else f"{c['mean_lifetime']:.1f}") + " | "
                  + ", ".join(f"{m:.3f}" for m in c["layer_miss_rates"]) + " |" for c in r["cache"]]
    fields = dict(
        r, name=name, name_repr=repr(name), transformers=r.get("transformers", transformers.__version__),
        params_total=f"{r['params_total']:,}",
        params_experts=f"{r['params_experts']:,}", experts_share=f"{r['experts_share']:.1%}",
        dir_mb=f"{r['dir_bytes'] / 1e6:.2f}", dir_bytes=f"{r['dir_bytes']:,}",
        train_cmd=t.get("command") or f"expertcache train --model {name} --ship", heldout_docs=h["docs"],
        train_tokens_available=f"{t.get('train_tokens_available', 0):,}", tokens_seen=f"{t.get('tokens_seen', 0):,}",
        steps_done=t.get("steps_done", 0), train_seq_len=tc.get("seq_len"), train_min=f"{t.get('train_wall_s', 0) / 60:.1f}",
        router_aux_loss_coef=t.get("spec", {}).get("router_aux_loss_coef"), threads=tc.get("threads"),
        **{k: tc.get(k) for k in ("batch_size", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip",
                                  "seed", "experts_implementation")},
        command=command, tokens_scored=f"{h['tokens_scored']:,}", ppl=f"{h['ppl']:.2f}",
        unigram_train=f"{h['unigram_ppl_train_freqs']:.1f}", unigram_self=f"{h['unigram_ppl_self_fit']:.1f}",
        wikitext_row=f"\n| WikiText-2 test (`wiki.test.raw`, {w['chars']:,} chars, out of domain) | "
                     f"{w['tokens_scored']:,} | {w['ppl']:.1f} |" if w else "",
        ratio=f"{h['ratio_to_best_unigram']:.3f}", uniform=f"{1 / r['num_experts']:.4f}",
        load_rows="\n".join(f"| {b['layer']} | {b['min_frac']:.4f} | {b['max_frac']:.4f} | {b['norm_entropy']:.3f} |"
                            for b in r["load_balance"]),
        cache_tokens=f"{r['cache_tokens']:,}", tokens_per_package=r["cache_tokens"] // len(r["cache_packages"]),
        packages=", ".join(r["cache_packages"]), cache_rows="\n".join(cache_rows), opening=OPENING_TOKENS,
        continuations="".join(f"**{c['source']}**\n\n```text\n{c['prompt']}⟦{c['continuation']}⟧\n```\n\n"
                              for c in r["continuations"]))
    fields.update(_card_words(name, tc.get("model") or name, r))
    template = (Path(__file__).with_name("templates") / "MODEL_CARD.md").read_text(encoding="utf-8")
    return string.Template(template).substitute(fields)


def _card_words(name: str, preset: str, r: dict) -> dict:
    """The card's words that differ between a shipped model (``SHIPPED_MODELS``) and one built by a command only
    (e.g. ``granular-256``, too large to ship); the shipped cards read as before."""
    from expertcache.assets import SHIPPED_MODELS

    tied = r.get("tied", True)  # cards written before the field: the shipped, tied models
    if preset in SHIPPED_MODELS and name == preset:
        return dict(kind="shipped model", purpose="as the package's embedded default",
                    params_note="tied embeddings counted once", cast_note="cast for shipping to stay under 16 MB",
                    shared_note="the two cores were shared with the other shipped model's training and other jobs",
                    use_path="from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                             "from expertcache.assets import shipped_model_dir\n\n"
                             f"path = shipped_model_dir({name!r})")
    return dict(kind="model (not shipped)",
                purpose=f"from the `{preset}` preset, not shipped in the package (built by the command below)",
                params_note="tied embeddings counted once" if tied else "untied embedding and lm_head",
                cast_note="cast to " + str(r.get("weights_dtype", "bf16")),
                shared_note="the two cores were shared with other jobs",
                use_path="from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                         f"path = {str(r.get('model_dir', name))!r}  # the trained folder")


def write_card(model_dir: str | Path, data_dir: str | None = None, max_tokens: int = 0, threads: int = 1,
               command: str = "") -> Path:
    """Evaluate ``model_dir`` and write ``card.json`` and ``MODEL_CARD.md`` into it. Returns the card path."""
    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").exists():
        raise FileNotFoundError(f"{model_dir} is not a trained model folder (no model.safetensors)")
    r = evaluate_model_dir(model_dir, data_dir or None, max_tokens=max_tokens, threads=threads)
    command = command or f"expertcache train --card-only {model_dir}"
    r["command"] = command
    card = model_dir / "MODEL_CARD.md"
    for _ in range(2):  # the folder size includes the card itself
        r["dir_bytes"] = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
        (model_dir / "card.json").write_text(json.dumps(r, indent=2) + "\n")
        card.write_text(render_card(r, command))
    return card
