"""``expertcache generate``: stream tokens from an MoE model whose experts are offloaded to disk or host RAM."""

from __future__ import annotations

import argparse
import json
import math
import sys

from expertcache.cache import DEFAULT_GAMMA, LIVE_EVICTIONS
from expertcache.cli.common import (add_device_arg, add_predictor_arg, add_routing_args, add_threads_arg, apply_threads, device_from_args, memory_spec,
                                    MAX_READERS, int_in, nonneg_float, nonneg_int, positive_int, predictor_from_args, print_resolved,
                                    prompt_text, routing_from_args, seed_int, unit_float)

DESCRIPTION = """\
Generate text with the experts offloaded: only C experts per MoE layer are in fast memory (from --memory or
--cache-experts); the rest are read from the checkpoint's safetensors files on every miss (--tier disk,
flash-faithful O_DIRECT reads by default) or copied from host RAM (--tier host). The router uses the chosen
policy against the live cache. Tokens are streamed to stdout; a summary line (tok/s, hit rate, bytes read)
goes to stderr.

  expertcache generate --memory 200MiB --policy cache-prior --lam 0.5 "The kernel"
  expertcache generate --model coarse --cache-experts 4 "apt-get install"

The prompt plus --max-new-tokens must fit in the model's context (max_position_embeddings in its
config.json; 256 for the shipped models): a longer request is refused before anything runs (no silent
truncation or sliding window). Non-finite logits (NaN/inf weights) stop the run with an error (exit 2).
"""


def add_offload_args(parser: argparse.ArgumentParser, *, default_io: str = "direct") -> None:
    """--model, --memory / --cache-experts, --tier, --io, --readers, --prefetch, --quant, --group, --dtype,
    --eviction, --gamma, --threads (defaults from OffloadConfig)."""
    from expertcache.offload import OffloadConfig
    from expertcache.offload.config import EXPERT_PRODUCTS
    from expertcache.offload.store import IO_MODES, TIERS
    from expertcache.offload.qlinear import DENSE_MODES
    from expertcache.offload.quant import KERNEL_GROUPS, QUANT_MODES, QUANT_PRESETS
    from expertcache.offload.lowtier import LOW_MODES

    parser.add_argument("--model", default="granular",
                        help="checkpoint folder, or a shipped model: granular | coarse (default: granular)")
    g = parser.add_argument_group("offloading")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--memory", type=memory_spec, default=None,
                      help="fast-memory budget (e.g. 3GiB, 200MiB, 'minimum' for K experts per layer, or 'auto': the "
                           "largest that keeps the whole process within its memory cgroup's limit): non-expert "
                           "weights + KV cache + expert slots. Inside a memory cgroup the whole process (this "
                           "budget + the interpreter's own memory + loading peaks) must fit the limit, else it is "
                           "refused before loading")
    size.add_argument("--cache-experts", type=positive_int, default=None, metavar="C",
                      help="expert slots per MoE layer (default: all N if no --memory)")
    g.add_argument("--tier", choices=TIERS, default="disk", help="where the experts live (default: disk)")
    g.add_argument("--host-memory", type=_host_memory_spec, default=None, metavar="SIZE",
                   help="with --tier disk: a host-RAM cache of expert bytes (e.g. 64MiB, its own LRU) between the "
                        "fast slots and the disk; a miss it holds is a memory copy (default: none)")
    g.add_argument("--io", choices=IO_MODES, default=default_io,
                   help=f"disk reads: direct (O_DIRECT), fadvise (drop page cache first), cached (default: {default_io})")
    d = OffloadConfig()
    g.add_argument("--readers", type=int_in(0, MAX_READERS, "reader threads"), default=None,
                   help=f"reader threads issuing expert reads in parallel with compute (0 = serial reads on the "
                        f"compute thread; default: 0 with --tier host, where a read is a memory copy (CPU) or an "
                        f"asynchronous copy queued on the copy stream (CUDA), shorter than a thread hand-off; "
                        f"{d.PARALLEL_READERS} with --tier disk)")
    g.add_argument("--prefetch", type=int, nargs="?", const=-1, default=d.prefetch, metavar="P",
                   help="next-layer speculative prefetch into P spare slots shared by all layers (counted in the "
                        "memory plan; --prefetch alone: P = 2K); default: off")
    g.add_argument("--compile", action="store_true",
                   help="the captured decode step: a one-row generation decodes each token as one torch.compile "
                        "graph against a static KV cache, the experts computed in it from their slots and the "
                        "routing policy and cache step as eager host calls inside it (same decisions; logits within "
                        "float rounding); other layouts and batches compile norms and attention per layer. The "
                        "first token pays the compilation: a minute to a few minutes on a first run (measured 1-4 min "
                        "on 2 CPU cores), seconds once torch's compile cache holds this model's code")
    g.add_argument("--expert-product", choices=EXPERT_PRODUCTS, default=d.expert_product,
                   help="a one-token step's expert products: mv (two matrix-vector products per expert, the "
                        "in-memory model's values bit for bit), grouped_mm (one torch._grouped_mm per matrix over "
                        "the slots), bmm (one batched product of the gathered matrices); auto: mv on a CPU, "
                        "grouped_mm on CUDA for bf16 on compute capability 9.0+, else bmm")
    g.add_argument("--quant", choices=(*QUANT_MODES, *QUANT_PRESETS), default=None,
                   help="quantised experts, packed once for torch's fused weight-only kernels: int8 (per output "
                        "channel, _weight_int8pack_mm) or int4 (group-wise, _weight_int4pack_mm / _for_cpu); where D "
                        "or F is not the kernel's multiple (int4: G, int8: 16; the shipped models) K is zero-padded, "
                        "never a slower path; the log names the kernel and padding. int4 is the fast one (int8 halves the "
                        "bytes, but its CPU kernel runs at about bf16's speed: BENCHMARKS.md). q4: the 4-bit preset "
                        "(int4 experts with least-squares scales, the dense part int8 unless --quant-dense int4; "
                        "BENCHMARKS.md gives its quality and bits per weight); q4m: fewer bits, per tensor like llama.cpp's "
                        "Q4_K_M (int4 experts, attention and embedding, lm_head int8: --quant-dense int4-head8)")
    g.add_argument("--group", type=int, choices=KERNEL_GROUPS, default=None, metavar="G",
                   help="int4 group size: 32, 64, 128 or 256 (the kernels'); default 64 where it divides D and F, "
                        "else 32 with K padded")
    g.add_argument("--quant-dense", choices=DENSE_MODES, default=d.quant_dense,
                   help="non-expert weights too: attention projections and lm_head through the same fused kernels "
                        "(int8 per channel / int4 G=32), the token embedding as int8 rows (default: none, or the --quant preset's; "
                        "none given beside a preset keeps the dense part unquantised); int4-head8: "
                        "attention and embedding int4, lm_head int8")
    m = parser.add_argument_group("mixed precision (a miss served at 4 bits instead of waited for)")
    m.add_argument("--resident-quant", choices=("none", *LOW_MODES), default="none",
                   help="every expert's int4 copy (the fused kernels' layout) resident beside the full-precision "
                        "slots, counted in the memory plan; a miss the rule below picks is computed from it now "
                        "instead of loaded (default: none)")
    m.add_argument("--low-threshold", type=nonneg_float, default=d.low_threshold, metavar="W",
                   help="HOBBIT's rule: a miss whose router weight is below W is computed at low precision (0 = "
                        "never; above 1 = every miss); needs --resident-quant")
    m.add_argument("--load-budget", type=_byte_count, default=None, metavar="BYTES",
                   help="full-precision loads per token and MoE layer (e.g. 2MiB), spent in descending weight "
                        "order; the other misses are computed at low precision (default: no budget)")
    m.add_argument("--promote-after", type=nonneg_int, default=d.promote_after, metavar="N",
                   help="an expert served at low precision N times is loaded (and admitted by --eviction) at its "
                        "next miss (0 = never; default: 0)")
    m.add_argument("--low-cost", type=unit_float, default=None, metavar="C",
                   help="cache-prior-cost's price of a low-precision compute in [0, 1] (0 as a hit, 1 as a load); "
                        "default: unpriced")
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    g.add_argument("--eviction", choices=LIVE_EVICTIONS, default="lru",
                   help="eviction policy (default: lru; gamma: 004's Top-C of discounted counts, gamma-admit: "
                   "discounted counts, always admits)")
    g.add_argument("--gamma", type=unit_float, default=DEFAULT_GAMMA,
                   help=f"γ of the gamma / gamma-admit cache in [0, 1] (default {DEFAULT_GAMMA})")
    add_threads_arg(g)
    add_device_arg(g)


def _byte_count(text: str) -> int:
    """argparse type of ``--load-budget``: a byte size (0 allowed: every miss at low precision)."""
    from expertcache.offload.budget import MINIMUM, parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 0 or n == MINIMUM:
        raise argparse.ArgumentTypeError(f"must be a byte size ≥ 0, got {text!r}")
    return n


def _host_memory_spec(text: str) -> str:
    from expertcache.offload.tiers import parse_host_memory

    try:
        parse_host_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--host-memory: ")) from None
    return str(text)


def add_routing_alias(parser: argparse.ArgumentParser) -> None:
    from expertcache.cli.common import live_policies

    parser.add_argument("--routing", dest="routing_policy", choices=live_policies(), default=argparse.SUPPRESS,
                        help="alias of --policy")


def offload_from_args(args, *, context: int, batch: int = 1, path=None):
    """The OffloadConfig of the parsed flags; sets torch's threads (``--threads``, auto by ``path``'s size).
    ``--prefetch`` without a count means K (read from ``path``'s config)."""
    from expertcache.offload import OffloadConfig

    device_from_args(args)  # args.device: the resolved device (a bad --device fails here, before any load)
    if getattr(args, "compile", False):
        from expertcache.models.captured import missing_compiler

        if (why := missing_compiler()) is not None:
            raise ValueError(why)
    apply_threads(args, path)
    prefetch = args.prefetch
    if prefetch == -1:
        prefetch = 2 * (_top_k(path) if path is not None else 8)
    elif prefetch < 0:
        raise ValueError(f"--prefetch must be >= 0, got {prefetch}")
    if path is not None and prefetch > (most := _expert_count(path)):
        raise ValueError(f"--prefetch {prefetch}: more spare slots than the model's {most} experts (all layers); "
                         f"give --prefetch ≤ {most}")
    host_memory = getattr(args, "host_memory", None)
    if host_memory is not None and args.tier != "disk":
        raise ValueError(f"--host-memory needs --tier disk (with --tier {args.tier} every expert is in host RAM already)")
    if args.group is not None and args.quant not in ("int4", "q4"):
        raise ValueError(f"--group applies to --quant int4 (int8 scales are per output channel), got --quant "
                         f"{args.quant or 'none'}")
    from expertcache.offload.quant import QUANT_PRESETS

    dense = getattr(args, "quant_dense", None)
    low = getattr(args, "resident_quant", "none")
    low = None if low in (None, "none") else low
    rule = dict(low_threshold=getattr(args, "low_threshold", 0.0), load_budget=getattr(args, "load_budget", None),
                promote_after=getattr(args, "promote_after", 0), low_cost=getattr(args, "low_cost", None))
    unset = dict(low_threshold=0.0, load_budget=None, promote_after=0, low_cost=None)
    given = [f"--{k.replace('_', '-')}" for k, v in rule.items() if v != unset[k]]
    if low is None and given:  # every flag of the low-precision rule does nothing without the low-precision tier
        raise ValueError(f"{' / '.join(given)}: {'it needs' if len(given) == 1 else 'they need'} --resident-quant "
                         "int4 (the rule chooses misses to compute at low precision)")
    if low is not None and low == args.quant:
        raise ValueError(f"--resident-quant {low} beside --quant {args.quant}: the slots already hold that precision")
    return OffloadConfig(tier=args.tier, io=args.io, capacity=args.cache_experts, memory=args.memory,
                         quant=args.quant, group=args.group, context=context, batch=batch, readers=args.readers,
                         prefetch=prefetch, host_memory=host_memory, quant_dense="none" if dense == "none" and args.quant in QUANT_PRESETS else
                         None if dense == "none" else dense,
                         compile=bool(getattr(args, "compile", False)), resident_quant=low,
                         expert_product=getattr(args, "expert_product", "auto"), **rule)


def _expert_count(path) -> int:
    """Routed experts over all layers of the checkpoint ``path`` (the most slots a prefetch could use)."""
    from expertcache.models.loader import read_config_json

    cfg = read_config_json(path)
    n = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(cfg.get(k), int)),
             None)
    layers = cfg.get("num_hidden_layers")
    return n * layers if isinstance(n, int) and isinstance(layers, int) else 1 << 20


def _top_k(path) -> int:
    from expertcache.models.loader import read_config_json

    k = read_config_json(path).get("num_experts_per_tok")
    return k if isinstance(k, int) else 8


def dtype_from_args(args):
    import torch

    return None if args.dtype is None else getattr(torch, args.dtype)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream tokens with experts offloaded to disk or host RAM",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", type=prompt_text,
                   help="prompt text (or space-separated token ids for a model without a tokenizer)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens to generate (default: 64; prompt + this must fit in the model's context)")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature (0 = greedy, default)")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON row (stderr)")
    add_offload_args(p)
    add_predictor_arg(p)
    add_routing_args(p, live=True)
    add_routing_alias(p)
    p.set_defaults(func=run, gc_paused_start=True)  # cli/gcpause.py: resumed at the first token


def load_prompt(path, prompt: str):
    """(input ids [1, S], tokenizer or None)."""
    import torch

    from expertcache.models.loader import load_tokenizer_checked, read_config_json

    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tok = load_tokenizer_checked(path)  # names tokenizer.json when it is missing or broken
        ids = tok(prompt, return_tensors="pt", verbose=False).input_ids  # too long: refused by check_context
        return ids, tok
    try:
        ids = [int(x) for x in prompt.split()]
    except ValueError:
        raise FileNotFoundError(f"{path / 'tokenizer.json'}: not found, so a text prompt cannot be encoded (add the "
                                "model's tokenizer, or give the prompt as space-separated token ids)") from None
    vocab = read_config_json(path).get("vocab_size")
    bad = [i for i in ids if i < 0 or (isinstance(vocab, int) and i >= vocab)]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return torch.tensor([ids]), None


def check_context(path, prompt_tokens: int, new_tokens: int, what: str = "--max-new-tokens") -> None:
    """Refuse a request longer than the model's context (max_position_embeddings of config.json)."""
    from expertcache.models.loader import read_config_json

    limit = read_config_json(path).get("max_position_embeddings")
    if isinstance(limit, int) and prompt_tokens + new_tokens > limit:
        raise ValueError(f"the prompt ({prompt_tokens} tokens) + {what} {new_tokens} = {prompt_tokens + new_tokens} "
                         f"positions exceed the model's context of {limit} (max_position_embeddings in "
                         f"{path / 'config.json'}); shorten the prompt or lower {what}")


def run(args: argparse.Namespace) -> int:
    from expertcache.cli.gcpause import resume_gc
    from expertcache.melinoe.prefetch import prefetch_runtime
    from expertcache.offload import OffloadedModel
    from expertcache.offload.runtime import resolve_model_path

    device_from_args(args)  # a bad --device: one line, before anything loads
    routing = routing_from_args(args)
    path = resolve_model_path(args.model)
    ids, tok = load_prompt(path, args.prompt)
    predictor = predictor_from_args(args)
    if ids.shape[1] == 0:
        from expertcache.models.loader import no_tokens_message

        raise ValueError(no_tokens_message(args.prompt))
    check_context(path, ids.shape[1], args.max_new_tokens)
    print_resolved("generate", routing, f", {args.eviction}")
    offload = offload_from_args(args, context=ids.shape[1] + args.max_new_tokens, path=path)
    rt = OffloadedModel.from_pretrained(path, offload, dtype=dtype_from_args(args), routing=routing,
                                        eviction=args.eviction, gamma=args.gamma, device=args.device)
    if args.memory == "auto":  # what the container's limit became
        print(f"expertcache generate: {rt.plan.describe()}", file=sys.stderr)
    out = sys.stdout
    shown = ""
    generated: list[int] = []

    def on_token(t_B1):
        nonlocal shown
        if not generated:
            resume_gc()  # the start is over (cli/gcpause.py)
        generated.append(int(t_B1[0, 0]))
        if tok is None:
            out.write(f"{generated[-1]} ")
        else:
            text = tok.decode(generated, skip_special_tokens=True)
            out.write(text[len(shown):])
            shown = text
        out.flush()

    eos = getattr(rt.config, "eos_token_id", None)
    if predictor is not None:  # MELINOE: the predicted Top-C of every layer, loaded before decoding
        prefetch_runtime(rt, predictor, [args.prompt], tok)

    def on_compile():  # after the prefill, before the first token: otherwise a silent pause of up to a minute
        print("expertcache generate: compiling the decode step (--compile; a first run takes minutes, seconds when "
              "torch's compile cache has this model's code)", file=sys.stderr, flush=True)

    r = rt.generate(ids, args.max_new_tokens, temperature=args.temperature, seed=args.seed, on_token=on_token,
                    stop=eos if isinstance(eos, int) else None, on_compile=on_compile)
    out.write("\n")
    s = rt.stats()
    d = r["decode_stats"]
    tok_s = r["decode_tokens"] / r["decode_s"] if r["decode_s"] > 0 else float("nan")
    row = dict(kind="generate", prompt_tokens=int(ids.shape[1]), new_tokens=int(r["tokens"].shape[1]),
               prefill_s=r["prefill_s"], decode_s=r["decode_s"], decode_tok_s=tok_s, compile_s=r["compile_s"],
               hit_rate=s["hit_rate"],
               decode_hit_rate=d["hit_rate"], bytes_read=s["bytes_read"], misses=s["misses"],
               fp_hits=s["hits"], low_computes=s["low_computes"], loads=s["misses"],
               io_wait_s=s["io_wait_seconds"], prefetch=s["prefetch"], prefetched=s["prefetched"], tiers=s["tiers"],
               transfers=s["expert_loads"],  # every expert load: demand misses + --predictor prefetch loads
               threads=args.threads, config=rt.describe())
    if predictor is not None:
        from expertcache.melinoe.prefetch import predictor_recall

        row.update(predictor_recall(predictor, rt.capacity))
    if args.json:
        print(json.dumps(row), file=sys.stderr)
    else:
        print(f"[{rt.family.model_type}, C={rt.capacity}/{rt.num_experts} per layer, {rt.routing.label()}+{rt.eviction}, "
              f"{offload.tier}{'/' + offload.io if offload.tier == 'disk' else ''}] "
              + (f"{tok_s:.2f} tok/s decode" if math.isfinite(tok_s) else "no decode step (one token: the prefill's)")
              + f", prefill {r['prefill_s']:.2f} s" + (f", decode step compiled in {r['compile_s']:.1f} s"
                                                        if r["compile_s"] else "") + f", hit rate {s['hit_rate']:.3f} "
              f"(decode {d['hit_rate']:.3f}), {s['bytes_read'] / 2**20:.1f} MiB read in {s['expert_loads']} expert loads"
              + (f", prefetch precision {s['prefetch']['precision']:.2f} recall {s['prefetch']['recall']:.2f}"
                 if s["prefetch"]["precision"] is not None else "") + (f" ({s['prefetched']} of them prefetched by --predictor)" if s["prefetched"] else "")
              + (f"; loads: {s['tiers']['host_hits']} from host RAM, {s['tiers']['disk_reads']} from disk"
                 if s["tiers"] else "") + f", {args.threads} thread(s)"
              + (f"; experts {row['config']['quant_kernel']}" if row["config"].get("quant_kernel") else "")
              + (f"; dense {row['config']['dense_kernel']}" if row["config"].get("dense_kernel") else "")
              + (f"; {s['hits']} full-precision hits, {s['low_computes']} int4 computes, {s['misses']} loads"
                 if offload.resident_quant else ""),
              file=sys.stderr)
    return 0
