"""An lm-evaluation-harness model that scores any lm-eval task on a cache-patched MoE model.

``ExpertCacheLM`` (registered in lm-eval's model registry as ``expertcache``) loads a checkpoint with
:func:`expertcache.eval.load_model_and_tokenizer`, installs a routing policy and one live expert cache per MoE
layer with :func:`expertcache.models.patch_model`, and answers lm-eval's three request types on it:

- ``loglikelihood`` (multiple choice: MMLU, HellaSwag, ...) -- one forward call per (context, continuation);
- ``loglikelihood_rolling`` (perplexity tasks) -- lm-eval's disjoint rolling windows of the model's context;
- ``generate_until`` (GSM8K, ...) -- greedy decoding with the KV cache until a stop string or ``max_gen_toks``.

Beside the task metric it reports the cache miss rate (misses / (tokens · layers · K), every token the model
processed, prompt tokens included) overall and per request type: :meth:`ExpertCacheLM.miss_report`, logged
after each request batch and printed by the launcher below.

**The miss rates are not the closed-loop ones of ``expertcache eval``.** lm-eval reorders requests (longest
first, grouped by request type) and, for multiple choice, runs the same context once per choice, so the
caches see a different stream of tokens than a user reading the documents in order. Use them to compare
policies under the same lm-eval task; quote ``expertcache eval`` for the miss rate of a policy.

Usage (lm-eval 0.4.x does not load plugin models by itself, so the launcher registers the model first and then
runs lm-eval's own command line with the same arguments)::

    python -m expertcache.integrations.lm_eval --model expertcache \\
        --model_args pretrained=granular,policy=cache-prior,lam=0.2,capacity=0.5 --tasks ... --limit 20

or from Python: ``lm_eval.simple_evaluate(model=ExpertCacheLM(pretrained=..., policy=...), tasks=[...])``.
The package also declares the entry point ``lm_eval.models: expertcache`` for lm-eval versions that read it.

:func:`write_local_tasks` writes task YAMLs over local copies of MMLU / GSM8K / WikiText-2 (no hub access)
for ``--include_path``.
"""

from __future__ import annotations

import logging
import string
import sys
from pathlib import Path
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("expertcache.integrations.lm_eval needs lm-eval: pip install 'expertcache[lmeval]'") from exc

import torch

from expertcache.results import atomic_write_bytes
from expertcache.routing import RoutingConfig
from expertcache.routing.registry import STRENGTH_RANGES

__all__ = ["ExpertCacheLM", "write_local_tasks", "main"]

log = logging.getLogger(__name__)

_TASKS = Path(__file__).with_name("lm_eval_tasks")  # task YAML templates ($test, $dev, $subject)
_INSTANCES: list = []  # every ExpertCacheLM built in this process: the launcher prints their miss rates

_FLOATS = (*STRENGTH_RANGES, "delta")
_INTS = ("m", "h", "top_j")


def _num(name: str, value: Any, kind) -> Any:
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"--model_args {name}={value!r}: not a {'whole number' if kind is int else 'number'}") from None


@register_model("expertcache")
class ExpertCacheLM(TemplateLM):
    """lm-eval model: a supported MoE checkpoint under a cache-aware routing policy (see the module docstring).

    pretrained: 'granular' / 'coarse' (shipped) or a checkpoint folder. policy + its strength (lam, p, alpha,
    beta, m, h, top_j, delta): the :class:`expertcache.routing.RoutingConfig`. capacity: experts per layer
    cache (count or fraction of N). eviction, scope ('all' | 'generation'), between_sequences ('carry' |
    'reset': per lm-eval request), freq_from: routing trace for the eras-bias profile. target_miss_rate: an
    online controller sets the strength (cache-prior / eras-bias) to hold this miss rate. device (lm-eval's
    ``--device``): auto (default: the first CUDA device, else the CPU), cpu, cuda or cuda:N. max_length: context
    (default the model's, capped at 1024); max_gen_toks: generation cap (default 256). batch_size must be 1
    (the caches see one token stream).
    """

    def __init__(self, pretrained: str = "granular", policy: str = "original", capacity: Any = 0.5,
                 eviction: str = "lru", scope: str = "all", between_sequences: str = "carry", freq_from: str | None = None,
                 target_miss_rate: Any = None, seed: Any = 0, max_length: Any = None, max_gen_toks: Any = 256,
                 threads: Any = 1, batch_size: Any = 1, device: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        from expertcache.eval import context_length, load_model_and_tokenizer
        from expertcache.models import patch_model

        routing = {n: _num(n, kwargs.pop(n), float if n in _FLOATS else int) for n in _FLOATS + _INTS if n in kwargs}
        for name in ("max_batch_size", "dtype", "trust_remote_code"):  # lm-eval's generic extras: ignored
            kwargs.pop(name, None)
        if kwargs:
            raise ValueError(f"--model_args: unknown option(s) {', '.join(sorted(kwargs))} for the expertcache model")
        routing = {k: v for k, v in routing.items() if v is not None or k == "delta"}
        self.routing = RoutingConfig(policy=policy, **routing)
        if str(batch_size) not in ("1", "auto") and _num("batch_size", batch_size, int) != 1:
            raise ValueError(f"--batch_size {batch_size}: the expertcache model runs one request at a time "
                             "(its caches see one token stream); use --batch_size 1")
        from expertcache.device import resolve_device

        # None (lm-eval's simple_evaluate without a device) or auto (the launcher, main(), when --device is not
        # given): the first CUDA device, else the CPU; a device this machine lacks is a ValueError naming --device
        self._device = resolve_device(device)
        torch.set_num_threads(_num("threads", threads, int) or 1)
        cap = capacity
        if isinstance(cap, str):
            cap = _num("capacity", cap, float)
            cap = int(cap) if cap is not None and cap >= 1 and cap == int(cap) else cap
        freq = None
        from expertcache.routing.registry import spec

        if spec(self.routing.policy).needs_profile:
            if not freq_from:
                raise ValueError(f"--model_args policy={self.routing.policy} needs freq_from=TRACE (activation profile)")
            from expertcache.analysis import load_freq

            freq = load_freq(freq_from)  # a trace, or a .npy / .json profile
        try:
            self.model, self.tokenizer = load_model_and_tokenizer(str(pretrained))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"--model_args pretrained={pretrained}: {exc}") from None
        self.model.to(self._device)
        self._max_length = _num("max_length", max_length, int) or context_length(self.model)
        self._max_gen_toks = _num("max_gen_toks", max_gen_toks, int) or 256
        self.patch = patch_model(self.model, self.routing, eviction=eviction, capacity=cap, scope=scope,
                                 between_sequences=between_sequences, seed=_num("seed", seed, int) or 0,
                                 freq_LE=freq)
        self.controller = None
        target = _num("target_miss_rate", target_miss_rate, float)
        if target is not None:  # budget-targeted routing: the strength is set online (docs/BEYOND.md)
            from expertcache.routing.budget import attach

            self.controller = attach(self.patch, target)
        self.pretrained = str(pretrained)
        self._by_kind: dict[str, list[int]] = {}  # request type -> [misses, slots]
        _INSTANCES.append(self)

    # -- lm-eval plumbing -----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.model.config.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- miss rates -------------------------------------------------------------------------------

    def _totals(self) -> tuple[int, int]:
        s = self.patch.stats()
        return sum(x.misses for x in s.per_layer), sum(x.steps for x in s.per_layer) * s.top_k

    def _account(self, kind: str, before: tuple[int, int]) -> None:
        after = self._totals()
        acc = self._by_kind.setdefault(kind, [0, 0])
        acc[0] += after[0] - before[0]
        acc[1] += after[1] - before[1]
        rate = acc[0] / acc[1] if acc[1] else 0.0
        log.info("expertcache %s: miss rate %.4f (%s)", kind, rate, self.routing.label())

    def miss_report(self) -> dict[str, Any]:
        """{'policy', 'capacity', 'miss_rate', 'miss_rate_by_request': {type: rate}, 'tokens'} so far."""
        misses, slots = self._totals()
        s = self.patch.stats()
        label = self.routing.label() if self.controller is None else \
            f"{self.routing.policy}(target miss rate {self.controller.config.target:g},J={self.routing.top_j})"
        return dict(policy=label, capacity=self.patch.capacity,
                    controller=None if self.controller is None else self.controller.state(),
                    miss_rate=misses / slots if slots else 0.0,
                    miss_rate_by_request={k: (m / n if n else 0.0) for k, (m, n) in self._by_kind.items()},
                    tokens=s.per_layer[0].steps if s.per_layer else 0,
                    note="lm-eval reorders requests: not the closed-loop miss rate of `expertcache eval`")

    # -- scoring ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether it is the greedy continuation: one forward call
        over (context + continuation)[-(max_length + 1):][:-1]."""
        whole = (context_enc + continuation_enc)[-(self.max_length + 1):]
        n = len(continuation_enc)
        if n == 0:
            return 0.0, True
        inp = torch.tensor([whole[:-1]], dtype=torch.long, device=self._device)
        logits = self.model(input_ids=inp).logits[0, -n:].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(whole[-n:], dtype=torch.long, device=self._device)
        ll = float(logp.gather(1, target[:, None]).sum())
        greedy = bool((logp.argmax(dim=-1) == target).all())
        self.patch.new_sequence()
        return ll, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        before = self._totals()
        out = []
        for (_, context_enc, continuation_enc) in tqdm(requests, desc="expertcache loglikelihood",
                                                        disable=disable_tqdm):
            out.append(self._score(context_enc, continuation_enc))
        self._account("loglikelihood", before)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        from tqdm import tqdm

        before = self._totals()
        out = []
        for req in tqdm(requests, desc="expertcache loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(self._score(ctx, cont)[0] for ctx, cont in windows))
        self._account("loglikelihood_rolling", before)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        from expertcache.eval.tasks import greedy_generate

        before = self._totals()
        out = []
        for req in tqdm(requests, desc="expertcache generate_until", disable=disable_tqdm):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.pop("max_gen_toks", self._max_gen_toks))
            if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0:
                log.warning("expertcache lm-eval model decodes greedily; ignoring sampling options %s", gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - 1):]
            max_new = max(1, min(max_new, self.max_length - len(ids)))
            new = greedy_generate(self.model, ids, max_new, stop_texts=until, tokenizer=self.tokenizer,
                                  eos_id=self.eot_token_id)
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            self.patch.new_sequence()
            out.append(text)
        self._account("generate_until", before)
        return out


# -- local task YAMLs (no hub access) ---------------------------------------------------------------

def write_local_tasks(data_dir: str | Path, out_dir: str | Path, *, mmlu_subjects: tuple[str, ...] = (
        "abstract_algebra", "high_school_geography")) -> list[str]:
    """Write lm-eval task YAMLs over the local copies in ``data_dir`` (the layout of ``shared/data``: mmlu/,
    gsm8k/, wikitext-2-raw-v1/) into ``out_dir``; returns the task names (``ec_mmlu_<subject>``,
    ``ec_gsm8k``, ``ec_wikitext``) of the files it wrote. Use with ``--include_path out_dir``. Data files are
    read by the ``datasets`` csv/json builders: nothing is downloaded."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []

    def put(name: str, template: str, **fields) -> None:
        text = string.Template((_TASKS / f"{template}.yaml").read_text(encoding="utf-8")).substitute(fields)
        atomic_write_bytes(out_dir / f"{name}.yaml", text.encode())
        names.append(name)

    for subject in mmlu_subjects:
        test, dev = (data_dir / "mmlu" / s / f"{subject}_{s}.csv" for s in ("test", "dev"))
        if test.is_file():
            put(f"ec_mmlu_{subject}", "ec_mmlu", subject=subject, test=test.resolve(), dev=dev.resolve())
    gsm = data_dir / "gsm8k" / "test.jsonl"
    if gsm.is_file():
        put("ec_gsm8k", "ec_gsm8k", test=gsm.resolve())
    wiki = data_dir / "wikitext-2-raw-v1" / "test.jsonl"
    if wiki.is_file():
        put("ec_wikitext", "ec_wikitext", test=wiki.resolve())
        atomic_write_bytes(out_dir / "ec_utils.py", b"def nonempty(dataset):\n"
                                                    b"    return dataset.filter(lambda d: len(d['text'].strip()) > 0)\n")
    return names


def main(argv: list[str] | None = None) -> int:
    """``python -m expertcache.integrations.lm_eval [lm_eval arguments]``: lm-eval's command line with the
    ``expertcache`` model registered, then the miss rates (stderr)."""
    from lm_eval.__main__ import cli_evaluate

    args = sys.argv[1:] if argv is None else list(argv)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        # lm-eval's own config defaults an absent --device to cuda:0, also on a machine without CUDA (refused there):
        # the expertcache model's default is auto (the first CUDA device, else the CPU)
        args += ["--device", "auto"]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()
    for lm in list(_INSTANCES):
        r = lm.miss_report()
        by = ", ".join(f"{k} {v:.4f}" for k, v in r["miss_rate_by_request"].items())
        print(f"expertcache: {r['policy']} capacity={r['capacity']}: miss rate {r['miss_rate']:.4f} over "
              f"{r['tokens']} tokens ({by}); lm-eval reorders requests, so this is not the closed-loop miss rate "
              "of `expertcache eval`", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
