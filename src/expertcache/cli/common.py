"""Argument groups shared by sub-commands, generated from the config dataclasses (defaults live there)."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, fields

from expertcache.cache import DEFAULT_GAMMA, EVICTION_POLICIES
from expertcache.routing import POLICIES, RoutingConfig

_HELP = {
    "policy": "routing policy",
    "top_j": "always keep the original top-J experts (default: the policy's paper: 1 for max-rank, cumsum and "
             "cache-prior (001), 0 for eras-threshold and eras-bias (003))",
    "h": "prune: keep ranks < h (default K)",
    "m": "max-rank: promote resident experts ranked < M",
    "p": "cumsum: cumulative-probability threshold in [0, 1]",
    "lam": "cache-prior: strength λ in [0, 1]",
    "delta": "cache-prior: fixed Δavg (default: running average of max(z)-min(z) per layer)",
    "alpha": "eras-threshold: α added to resident experts' probabilities",
    "beta": "eras-bias: β scale of the penalty on non-resident experts",
}


def live_policies() -> tuple[str, ...]:
    """The policies a command without an activation profile can run (``generate``, ``serve``): every registered
    one but those that need a profile (ERAS biasing, read from a trace by eval/sweep/simulate/bench)."""
    from expertcache.routing.registry import SPECS

    return tuple(p for p in POLICIES if not SPECS[p].needs_profile)


def add_routing_args(parser: argparse.ArgumentParser, *, live: bool = False) -> None:
    """--policy, --top-j, --h, --m, --p, --lam, --delta, --alpha, --beta (from RoutingConfig). ``live``: a command
    that takes no activation profile -- the policies that need one are not offered (:func:`live_policies`)."""
    g = parser.add_argument_group("routing policy")
    for f in fields(RoutingConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP[f.name] if f.name == "top_j" else f"{_HELP[f.name]} (default: {f.default})"
        kw = dict(dest=f"routing_{f.name}", default=f.default, help=help_)
        if f.name == "policy":
            if live:
                kw["help"] += " (policies that need an activation profile run in eval, sweep, simulate and bench)"
            g.add_argument(flag, choices=live_policies() if live else POLICIES, **kw)
        elif f.name in ("top_j", "h", "m"):
            g.add_argument(flag, type=int, **kw)
        else:
            g.add_argument(flag, type=float, **kw)


def routing_from_args(args: argparse.Namespace) -> RoutingConfig:
    """The RoutingConfig of the parsed flags; its validation errors name the flag (``--alpha ...``)."""
    from expertcache.cli.main import UsageError

    try:
        return RoutingConfig(**{f.name: getattr(args, f"routing_{f.name}") for f in fields(RoutingConfig)})
    except ValueError as exc:
        raise UsageError(flag_message(str(exc), [f.name for f in fields(RoutingConfig)])) from None


def flag_message(msg: str, names) -> str:
    """``msg`` with a leading option name (``alpha must ...``) written as its flag (``--alpha must ...``)."""
    for name in names:
        if msg.startswith(name + " "):
            return "--" + name.replace("_", "-") + msg[len(name):]
    return msg


def add_dataclass_args(parser, cls, *, helps: dict | None = None, choices: dict | None = None, defaults=None) -> None:
    """One flag per scalar field of the config dataclass ``cls`` (``--field-name``, dest = the field name), so the
    defaults live only there (``defaults``: an instance whose values to show instead). Numbers are checked when
    parsed (ints ≥ 0, finite floats); ranges are the config's own check. ``helps``/``choices``: by field name."""
    for f in fields(cls):
        default = getattr(defaults, f.name) if defaults is not None else f.default
        if default is MISSING:  # a collection (default_factory): not a flag
            continue
        typ = {int: seed_int if f.name.endswith("seed") else nonneg_int, float: finite_float}.get(type(default), str)
        kw = dict(dest=f.name, type=typ, default=default, choices=(choices or {}).get(f.name))
        if helps is not None:
            kw["help"] = f"{helps.get(f.name, f.name)} (default: {default})"
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def config_from_args(cls, args: argparse.Namespace):
    """The ``cls`` instance of the flags :func:`add_dataclass_args` added."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def check_target(routing: RoutingConfig, target: float, flags: str = "--target-miss-rate") -> None:
    """Refuse a miss-rate target outside (0, 1), or for a policy the controller cannot steer."""
    if not (math.isfinite(target) and 0.0 < target < 1.0):
        raise ValueError(f"--target-miss-rate must be in (0, 1), got {target}")
    from expertcache.routing.registry import STEERABLE

    if routing.policy not in STEERABLE:
        raise ValueError(f"{flags} control {' or '.join(STEERABLE)}, not --policy {routing.policy}")


def steerable() -> str:
    """The policies a miss-rate target can steer, with their strength, for help texts: ``cache-prior (lam), ...``
    (read from the registry when the parser is built, so a registered steerable policy is listed)."""
    from expertcache.routing.registry import SPECS, STEERABLE

    return ", ".join(f"{p} ({SPECS[p].strength})" for p in STEERABLE)


def target_label(routing: RoutingConfig, target: float) -> str:
    """The policy label of budget-targeted routing, e.g. ``cache-prior(target miss rate 0.1,J=1)``."""
    return f"{routing.policy}(target miss rate {target:.4g},J={routing.top_j})"


def pct(x) -> str:
    """``x`` as a percentage with one decimal; '-' for None or NaN."""
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def print_controller(ctl: dict, file) -> None:
    """The miss-rate controller's line under the eval / simulate tables (``ctl``: its ``state()``)."""
    sat = [x for x in ctl["saturated"] if x]
    print(f"controller target {pct(ctl['target'])}   achieved {pct(ctl['miss_rate'])}   final strength "
          f"{ctl['strengths'][0]:.4g}" + (f"   SATURATED at the {sat[0]} strength: target out of reach" if sat
                                         else ""), file=file)


def print_resolved(command: str, routing: RoutingConfig, extra: str = "") -> None:
    """One line on stderr with the resolved routing configuration (policy defaults filled in)."""
    import sys

    print(f"expertcache {command}: routing {routing.label()}{extra}", file=sys.stderr)


def add_cache_args(parser: argparse.ArgumentParser, *, default_capacity: str = "0.5") -> None:
    g = parser.add_argument_group("expert cache")
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru",
                   help="eviction policy (default: lru; gamma: 004 Def. C.1, resident = Top-C of γ-discounted "
                   "counts, a low-count miss is a transient load; gamma-admit: discounted counts, always admits)")
    g.add_argument("--capacity", type=capacity_spec, default=default_capacity,
                   help=f"experts per layer in fast memory: a count (16) or a fraction of N (0.5) "
                        f"(default: {default_capacity})")
    add_cache_state_args(g)


def add_cache_state_args(g) -> None:
    """--gamma, --initial, --seed, --between-sequences: the cache options besides eviction and capacity."""
    g.add_argument("--gamma", type=unit_float, default=DEFAULT_GAMMA, help="γ of the gamma / gamma-admit cache in [0, 1] (1 = LFU, "
                   f"0 = LRU; default {DEFAULT_GAMMA})")
    g.add_argument("--initial", default="empty", choices=("empty", "random"), help="initial cache state")
    g.add_argument("--seed", type=seed_int, default=0, help="seed for a random initial state")
    g.add_argument("--between-sequences", choices=("carry", "reset"), default="carry",
                   help="keep caches across sequences (carry) or start each sequence empty (reset)")


# ---------------------------------------------------------------------------------------------
# argparse types: every count / number flag is checked when parsed, and the message names the flag
# (argparse prefixes "argument --flag: "); the parser prints it as one line and exits with code 2.


def _int_at_least(text: str, lo: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ {lo}, got {text!r}") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"must be ≥ {lo}, got {value}")
    return value


def prompt_text(text: str) -> str:
    """argparse type: text that tokenizers can take (valid UTF-8 on the command line; :func:`check_text`)."""
    from expertcache.inputs import check_text

    try:
        return check_text(text, "text")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("text: ")) from None


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    return _int_at_least(text, 1)


def int_in(lo: int, hi: int, why: str = ""):
    """argparse type: an integer in [lo, hi]; the message says the bound and ``why`` it is one."""
    def parse(text: str) -> int:
        value = _int_at_least(text, lo)
        if value > hi:
            raise argparse.ArgumentTypeError(f"must be ≤ {hi}{f' ({why})' if why else ''}, got {value}")
        return value
    return parse


#: the largest seed: numpy's legacy ``np.random.seed`` takes 32 bits (torch 64); a larger one failed deep inside
#: ("Overflow when unpacking long long")
MAX_SEED = 2**32 - 1
seed_int = int_in(0, MAX_SEED, "a 32-bit seed")

#: threads per CPU core a flag may ask for: more only contend, and thousands crashed torch (a segfault at 1999)
THREADS_PER_CORE = 4
#: the most reader threads of the I/O queue: reads beyond a few dozen in flight only queue in the device
MAX_READERS = 64


def max_threads(cores: int | None = None) -> int:
    """The most compute threads a flag may ask for on this machine: :data:`THREADS_PER_CORE` per CPU core."""
    import os

    return THREADS_PER_CORE * (cores or os.cpu_count() or 1)


def nonneg_int(text: str) -> int:
    """argparse type: an integer ≥ 0."""
    return _int_at_least(text, 0)


def finite_float(text: str) -> float:
    """argparse type: a finite float (no nan / inf)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """argparse type: a finite float ≥ 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def unit_float(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def capacity_spec(text: str) -> str:
    """argparse type of ``--capacity``: an expert count (16) or a fraction of N (0.5), finite; the range check
    against N happens once N is known (:func:`expertcache.cache.resolve_capacity`)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be an expert count (16) or a fraction of N (0.5), "
                                         f"got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"capacity must be a finite expert count or fraction of N, got {text!r}")
    return str(text).strip()


def csv_of(parse, what: str, empty_ok: bool = False):
    """argparse type: comma-separated values (at least one, or none when ``empty_ok``), each checked by the
    argparse type ``parse``; the value is the cleaned text (``"a,b"``)."""
    def parse_list(text: str) -> str:
        items = [x.strip() for x in str(text).split(",") if x.strip()]
        if not items and not empty_ok:
            raise argparse.ArgumentTypeError(f"give at least one {what}")
        for x in items:
            parse(x)
        return ",".join(items)
    return parse_list


def one_of(options, what: str):
    """argparse type: one of ``options``."""
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose among {', '.join(options)}")
        return text
    return parse


capacity_list = csv_of(capacity_spec, "cache size")  # sweep's --capacity


def memory_spec(text: str) -> str:
    """argparse type of ``--memory``: a byte size such as 3GiB, 200MiB or a byte count (> 0), 'minimum' or
    'auto' (the memory cgroup's limit)."""
    from expertcache.offload.budget import AUTO, MINIMUM, parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0 and n not in (MINIMUM, AUTO):
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return str(text)


# ---------------------------------------------------------------------------------------------
# output paths: checked before any computation starts


def check_output_path(path, flag: str, *, directory: bool = False):
    """Refuse (UsageError naming ``flag`` and the path) an output that cannot be written: a folder where a
    file is expected (or a file where a folder is), a path under a regular file, or a location without
    write permission. Creates nothing. Returns the path as a ``Path``; ``None`` passes through."""
    import os
    from pathlib import Path

    from expertcache.cli.main import UsageError

    from expertcache.outputs import is_stream, name_max

    if path is None or path == "":
        return None
    if not directory and is_stream(path):  # /dev/stdout, /dev/null: written in place
        return Path("/dev/stdout" if str(path) == "-" else path)
    p = Path(path).expanduser()
    if any(len(os.fsencode(part)) > 255 for part in p.parts):
        raise UsageError(f"{flag} {str(path)[:60]}...: a file or folder name is longer than 255 bytes")
    anc0 = p.parent
    while not anc0.exists() and anc0 != anc0.parent:
        anc0 = anc0.parent
    if anc0.is_dir() and len(os.fsencode(p.name)) > name_max(anc0):
        raise UsageError(f"{flag} {str(path)[:60]}...: the name is longer than the {name_max(anc0)} bytes the file "
                         "system takes")
    if directory:
        if p.exists() and not p.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a folder")
    elif p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder, expected a file name")
    anc = p if (directory and p.is_dir()) else p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise UsageError(f"{flag} {path}: {anc} is a file, not a folder")
    if p.exists() and not p.is_dir():
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable (permission denied)")
    elif not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write into {anc} (permission denied)")
    return p


def check_input_file(path, flag: str):
    """Refuse (FileNotFoundError naming ``flag``) an input path that is not an existing regular file."""
    from pathlib import Path

    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise FileNotFoundError(f"{flag} {path}: not a regular file")
    return p
# -- torch CPU threads (every command that runs a model) ------------------------------------------

#: below this hidden size a model's per-token ops are tiny ([1, D] × [D, F]): one thread is fastest, and
#: any extra thread only spins -- on a busy 2-core VM torch's default 2 threads made a [1,144]×[144,576]
#: linear ~1000× slower (18 ms vs 20 µs) and `generate` 20-60× slower (issue 10).
SMALL_HIDDEN = 1024


def default_threads(hidden_size: int | None = None, cores: int | None = None) -> int:
    """The ``--threads auto`` rule: 1 for small models (hidden < ``SMALL_HIDDEN`` or unknown) and on
    machines with at most 2 cores; otherwise half the cores (a decode step's matmuls are [1, D] × [D, F]:
    more threads than that contend with the reader threads and anything else running), at most 8."""
    import os

    cores = cores or os.cpu_count() or 1
    if hidden_size is None or hidden_size < SMALL_HIDDEN or cores <= 2:
        return 1
    return max(1, min(8, cores // 2))


def add_threads_arg(parser) -> None:
    """``--threads N|auto`` (default auto, see :func:`default_threads`)."""
    parser.add_argument("--threads", default="auto", type=_threads_type,
                        help="torch CPU threads: a number, or auto (default) = 1 for models with hidden size "
                             f"< {SMALL_HIDDEN} or on machines with <= 2 cores, else half the cores (max 8)")


def _threads_type(text: str):
    if text == "auto":
        return text
    return int_in(1, max_threads(), f"{THREADS_PER_CORE} per CPU core of this machine")(text)


def apply_threads(args: argparse.Namespace, model=None) -> int:
    """Set torch's CPU threads from ``args.threads`` (``auto``: :func:`default_threads` of ``model``'s hidden
    size -- a checkpoint folder, a config or a model; None = small). Returns the count set."""
    import torch

    n = getattr(args, "threads", "auto")
    if n in (None, "auto"):
        n = default_threads(_hidden_size(model))
    torch.set_num_threads(int(n))
    args.threads = int(n)
    return int(n)


def _hidden_size(model) -> int | None:
    if model is None:
        return None
    from pathlib import Path

    from expertcache.jsonsafe import load_path

    if isinstance(model, (str, Path)):
        try:
            return int(load_path(Path(model) / "config.json").get("hidden_size"))
        except (OSError, ValueError, TypeError, AttributeError):
            return None
    cfg = getattr(model, "config", model)
    return getattr(cfg, "hidden_size", None)


def add_predictor_arg(parser) -> None:
    """--predictor PATH (MELINOE, 004): prefetch the predicted Top-C experts per layer before decoding."""
    parser.add_argument("--predictor", default=None, metavar="PATH",
                        help="MELINOE expert-activation predictor (from `expertcache melinoe predictor`): load the "
                             "Top-C predicted experts of every layer before decoding (a batch pools its rows); "
                             "prefetch loads are counted apart from misses")


def predictor_from_args(args):
    """The loaded predictor of ``--predictor`` (checked before any long work), or None."""
    if not getattr(args, "predictor", None):
        return None
    from expertcache.melinoe.predictor import Predictor

    return Predictor.load(args.predictor)


# -- compute device (every command that runs a model) ---------------------------------------------

DEVICE_HELP = ("compute device: auto (default) = cuda:0 when torch sees a CUDA device, else cpu; cpu; cuda; "
               "cuda:N")


def device_spec(text: str) -> str:
    """argparse type of ``--device`` (:func:`expertcache.device.parse_device`: syntax only)."""
    from expertcache.device import DEVICE_CHOICES, parse_device

    try:
        return parse_device(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; choose {DEVICE_CHOICES}") from None


def add_device_arg(parser) -> None:
    """``--device {auto,cpu,cuda,cuda:N}`` (default auto)."""
    parser.add_argument("--device", default="auto", type=device_spec, metavar="{auto,cpu,cuda,cuda:N}",
                        help=DEVICE_HELP)


def device_from_args(args: argparse.Namespace):
    """Resolve ``args.device`` (:func:`expertcache.device.resolve_device`) in place -- its string in
    ``args.device`` -- and return the ``torch.device``. A device this machine lacks: one line naming
    ``--device``, exit 2, before any model is loaded."""
    from expertcache.cli.main import UsageError
    from expertcache.device import resolve_device

    try:
        dev = resolve_device(getattr(args, "device", "auto"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.device = str(dev)
    return dev
