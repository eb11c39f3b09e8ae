"""Loading a Hugging Face MoE checkpoint (local folder or hub name) for expertcache, with the checks that turn
a damaged or inconsistent folder into one clear error naming the file (before transformers sees it)."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from expertcache.jsonsafe import JSONError, load_path
from expertcache.models.adapters import family_for
from expertcache.tensorfile import index_shards, read_header

__all__ = ["load_model", "read_config_json", "check_config_values", "load_config_checked", "check_weights_match_config", "load_tokenizer_checked", "check_tokenizer_encodes", "no_tokens_message",
           "check_tokenizer_fits",
           "is_hub_name", "fetch_hub_model", "resolve_model_path", "HUB_FILES"]


def json_object_file(path: Path, missing: str) -> dict:
    """The JSON object in the file ``path``: FileNotFoundError ``path: not found (missing)`` without it, ValueError
    naming it when it is not UTF-8, not JSON, nested too deep or not an object."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found ({missing})")
    try:
        data = load_path(path)  # a FIFO, a folder, a device: "not a regular file"
    except JSONError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def read_config_json(folder: str | os.PathLike) -> dict:
    """``folder/config.json`` as a dict. FileNotFoundError / ValueError naming the file when it is missing,
    not UTF-8, not JSON or not a JSON object."""
    path = Path(folder) / "config.json"
    data = json_object_file(path, f"{folder} is not a checkpoint folder")
    if "model_type" not in data:
        raise ValueError(f"{path}: no model_type (not a transformers config)")
    check_config_values(data, path)
    return data


#: config.json keys that are sizes or counts: (smallest valid value); ``null`` is allowed (a key a family leaves unset)
CONFIG_INTS = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
                     "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
                     "head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "moe_layer_freq", "decoder_sparse_step", "n_group", "topk_group"), 1),
    **dict.fromkeys(("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace"), 0),
}
#: config.json keys that are positive real numbers
CONFIG_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
#: the most parameters a config may imply over what its safetensors files hold (a generous margin: the estimate
#: below ignores grouped KV heads, dense layers, shared experts and biases)
CONFIG_SIZE_MARGIN = 16


def check_config_values(data: dict, path: str | os.PathLike) -> None:
    """The numeric keys of a config.json are sizes of the right type and range, top-k is within the experts, and
    the size the config implies fits the weights stored beside it. ValueError naming the file and the key
    otherwise -- before transformers builds anything from it (a negative size fails deep inside torch; a config
    of a million layers takes minutes to build before any check could run)."""
    for key, low in CONFIG_INTS.items():
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{path}: {key} must be an integer >= {low}, got {json.dumps(v)}")
    for key in CONFIG_POSITIVE_FLOATS:
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            raise ValueError(f"{path}: {key} must be a positive finite number, got {json.dumps(v)}")
    act = data.get("hidden_act")
    if act is not None:
        try:
            from transformers.activations import ACT2FN
        except ImportError:  # the command names the missing extra itself
            ACT2FN = None
        if ACT2FN is not None and (not isinstance(act, str) or act not in ACT2FN):
            raise ValueError(f"{path}: hidden_act {json.dumps(act)} is not an activation transformers knows")
    e_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if data.get(k) is not None), None)
    k_key = next((k for k in ("num_experts_per_tok", "experts_per_token") if data.get(k) is not None), None)
    if e_key and k_key and data[k_key] > data[e_key]:
        raise ValueError(f"{path}: {k_key}={data[k_key]} must be in [1, {e_key}={data[e_key]}] (top-k of the experts)")
    _check_config_size(data, Path(path))


def _check_config_size(data: dict, path: Path) -> None:
    """Refuse a config that implies far more parameters than the safetensors files beside it hold."""
    H, L = data.get("hidden_size"), data.get("num_hidden_layers")
    files = _weight_files(path.parent)
    if not (H and L and files):
        return
    try:
        have = sum(math.prod(t.shape) for f in files for t in read_header(f).values())
    except (ValueError, OSError):
        return  # a damaged weights file: check_weights_match_config / the loaders name it
    E = next((data[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if data.get(k)), 1)
    F = data.get("moe_intermediate_size") or data.get("intermediate_size") or 4 * H
    implied = L * (4 * H * H + E * 3 * H * F) + (data.get("vocab_size") or 0) * H
    if implied > CONFIG_SIZE_MARGIN * have + 10**6:
        raise ValueError(f"{path}: the config (num_hidden_layers={L}, hidden_size={H}, {E} experts of "
                         f"{F}) implies ~{implied:.3g} parameters, the safetensors files beside it hold {have:.3g}; "
                         "the config does not describe these weights")


#: weight files written with pickle (torch.save): never loaded
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _weight_files(folder: Path) -> list[Path]:
    """The model's safetensors files (not expertcache's quantised sidecars)."""
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("expertcache-"))


def check_weights_match_config(folder: str | os.PathLike, config, model: nn.Module | None = None) -> None:
    """Compare the tensor shapes the config implies with the safetensors headers of ``folder`` (no weights
    are read): every tensor present under the same name must have the same shape, and the routed experts
    (``.experts.`` keys, stored per expert or fused) must hold as many values as the config says. ValueError
    naming the file and the config fields otherwise. ``model``: the model already built from ``config`` (on
    the meta device), else one is built. Folders without safetensors files are left to transformers."""
    folder = Path(folder)
    index = index_shards(folder)  # a shard outside the folder is refused before anything reads it
    files = _weight_files(folder)
    if not files and index is None:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_SUFFIXES)
        if pickled:
            raise ValueError(f"{folder}: its weights are pickled ({', '.join(pickled[:3])}), which expertcache never "
                             "loads (unpickling can run code); convert them to safetensors")
        return
    disk: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        for key, t in read_header(f).items():  # CheckpointError (a ValueError) names a truncated/corrupt file
            disk[key] = (tuple(t.shape), f.name)
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    expected = model.state_dict(keep_vars=True)
    fields = ", ".join(f"{k}={getattr(config, k)}" for k in ("hidden_size", "intermediate_size",
                                                              "moe_intermediate_size", "num_experts",
                                                              "num_local_experts", "n_routed_experts")
                       if getattr(config, k, None) is not None)
    for key, t in expected.items():
        if key in disk and disk[key][0] != tuple(t.shape):
            shape, name = disk[key]
            raise ValueError(f"{folder / 'config.json'} ({fields}) does not match {folder / name}: {key} is "
                             f"{list(shape)} in the file, the config implies {list(t.shape)}")
    want = sum(t.numel() for t in {id(t): t for key, t in expected.items() if ".experts." in key}.values())
    have = sum(math.prod(shape) for key, (shape, _) in disk.items() if ".experts." in key)
    per_layer = Counter(key.split(".experts.")[0] for key in disk if ".experts." in key)
    uniform = len(set(per_layer.values())) <= 1  # else a tensor is missing: the loaders name it
    if want and have and want != have and uniform:
        raise ValueError(f"{folder / 'config.json'} ({fields}) does not match the expert tensors of "
                         f"{', '.join(f.name for f in files)}: the config implies {want} expert weights, the files "
                         f"hold {have}")


def load_config_checked(folder: str | os.PathLike, **kwargs):
    """``AutoConfig.from_pretrained(folder)`` after :func:`read_config_json`; transformers' own validation of the
    fields (a string where a bool belongs, an unknown model_type, ...) becomes a ValueError naming config.json."""
    from transformers import AutoConfig

    read_config_json(folder)
    kwargs.setdefault("local_files_only", True)
    try:
        return AutoConfig.from_pretrained(str(folder), **kwargs)
    except (OSError, ImportError):  # a missing file / package: named by the callers
        raise
    except Exception as exc:  # huggingface_hub's StrictDataclassFieldValidationError is not a ValueError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{Path(folder) / 'config.json'}: not a valid config ({first})") from None


def load_tokenizer_checked(folder: str | os.PathLike):
    """The fast tokenizer of a local model folder. FileNotFoundError when ``tokenizer.json`` is missing,
    ValueError naming the file when it cannot be read."""
    from transformers import AutoTokenizer

    config = read_config_json(folder)  # AutoTokenizer reads config.json too: name it when it is the broken file
    load_config_checked(folder)  # ... and validates it through transformers' config class
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (the model folder has no tokenizer; copy its tokenizer.json "
                                "and tokenizer_config.json there)")
    # without tokenizer_config.json the special tokens are unknown (ids past the vocabulary followed)
    json_object_file(Path(folder) / "tokenizer_config.json", "the model folder's tokenizer needs it beside "
                     "tokenizer.json: copy the model's own")
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # tokenizers raises plain Exception for a malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path}: not a valid tokenizer file ({first})") from None
    check_tokenizer_fits(tok, config.get("vocab_size"), path)
    check_tokenizer_encodes(tok, path)
    return tok


#: the text a loaded tokenizer must turn into at least one token
PROBE_TEXT = "The kernel loads the module."


def check_tokenizer_encodes(tok, path: str | os.PathLike) -> None:
    """A tokenizer (file ``path``) that turns plain text into no tokens is refused, naming the file: every prompt
    would then read as "empty" and the user's text would be blamed (a normalizer that deletes everything, ...)."""
    try:
        ids = tok(PROBE_TEXT, verbose=False).input_ids
    except Exception as exc:  # tokenizers raises plain Exception
        raise ValueError(f"{path}: the tokenizer fails on plain text ({str(exc).strip()[:120]})") from None
    if not ids:
        raise ValueError(f"{path}: the tokenizer produces no tokens (for {PROBE_TEXT!r}); it cannot encode a "
                         "prompt -- fix or replace the model's tokenizer")


def no_tokens_message(text: str, what: str = "prompt") -> str:
    """The error for a ``what`` that encoded to no tokens: "empty" only when it is blank, else the tokenizer's
    doing (it dropped every character), never the user's."""
    if not text.strip():
        return f"empty {what}"
    return (f"the model's tokenizer produced no tokens for the {what} ({len(text)} characters): it drops this text; "
            "the tokenizer, not the text, is at fault")


def check_tokenizer_fits(tok, vocab: int | None, path: str | os.PathLike) -> None:
    """A tokenizer (file ``path``) whose ids exceed the model's embedding (``vocab`` rows) is refused: those ids
    fail as an IndexError inside the embedding. One covering less than 90 % of the rows warns
    (:class:`~expertcache.inputs.InputWarning`): the model would generate ids it cannot decode. (Models pad their
    vocabulary past the tokenizer, to a multiple of 64 or 128 -- DeepSeek-V2 by 2.3 % -- so a small gap is normal.)"""
    import warnings

    from expertcache.inputs import InputWarning

    n = len(tok)
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    if n > vocab:
        raise ValueError(f"{path}: the tokenizer has {n} tokens (ids up to {n - 1}), the model's embedding only {vocab} "
                         f"rows (vocab_size in config.json): not this model's tokenizer")
    if n < 0.9 * vocab:
        warnings.warn(f"{path}: the tokenizer has {n} tokens, the model's vocabulary {vocab} (vocab_size in "
                      f"config.json): ids {n}..{vocab - 1} that the model may generate decode to nothing -- is this "
                      "the model's own tokenizer?", InputWarning, stacklevel=2)


# What a hub download fetches: configs, safetensors weights and tokenizer files -- never pickled weights
# (``*.bin``, ``*.pt``), never remote code (``*.py``).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_name(name: str | os.PathLike) -> bool:
    """True when ``name`` is not an existing path and reads as a Hugging Face hub id ``owner/name``."""
    text = os.fspath(name)
    return not os.path.exists(os.path.expanduser(text)) and bool(_HUB_NAME.fullmatch(text)) and ".." not in text


def fetch_hub_model(name: str, revision: str | None = None) -> Path:
    """Local folder of hub model ``name`` (``owner/name``): the hub cache's copy, downloaded first if needed
    (configs, safetensors and tokenizer files only, see ``HUB_FILES``). FileNotFoundError in one line when the
    model is not local and cannot be downloaded (offline, ``HF_HUB_OFFLINE=1``, unknown or gated repository)."""
    from huggingface_hub import constants, errors, snapshot_download

    try:
        folder = snapshot_download(name, revision=revision, allow_patterns=HUB_FILES)
    except Exception as exc:  # offline, HTTP, auth, not-found: all mean "cannot get it"
        if isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
            why = "the hub has no such repository or revision (or it is private / gated)"
        elif constants.HF_HUB_OFFLINE:
            why = "the hub is unreachable: HF_HUB_OFFLINE is set"
        else:
            first = str(exc).strip().split(". ")[0].splitlines()[0][:160] if str(exc).strip() else ""
            why = f"the hub is unreachable ({type(exc).__name__}{': ' + first if first else ''})"
        raise FileNotFoundError(f"model {name!r} is not a local folder nor in the local hub cache, and {why}; "
                                f"give a local checkpoint folder, 'granular' or 'coarse'") from None
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"hub model {name!r} has no safetensors weights (pickled weights are not loaded)")
    return folder


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """``'granular'``/``'coarse'`` (when no such local folder exists) → the shipped model folder; a hub name
    ``owner/name`` that is not a local path → its local copy (downloaded if needed, :func:`fetch_hub_model`);
    anything else must be a checkpoint folder (FileNotFoundError naming it otherwise)."""
    from expertcache.assets import SHIPPED_MODELS, shipped_model_dir

    if str(spec) in SHIPPED_MODELS and not Path(spec).exists():
        return shipped_model_dir(str(spec))
    if is_hub_name(spec):
        return fetch_hub_model(str(spec))
    if not str(spec).strip():  # Path("") is the current folder
        raise FileNotFoundError("--model is empty: give a checkpoint folder, 'granular', 'coarse' or a hub name "
                                "owner/name")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"--model {spec}: no such model folder (give a checkpoint folder, 'granular', "
                                "'coarse' or a hub name owner/name)")
    return path


def load_model(path_or_hub_name: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs) -> nn.Module:
    """Load a supported MoE causal LM with ``AutoModelForCausalLM.from_pretrained`` in eval mode.

    A local folder is read without touching the network; a hub name ``owner/name`` is fetched with
    :func:`fetch_hub_model` (needs network access or the local hub cache; configs, safetensors and tokenizer
    files only) and then read from its local copy. ``kwargs`` go to ``from_pretrained`` (e.g. ``device_map``,
    ``revision``). Raises ValueError listing the supported ``model_type`` values when the checkpoint is
    not one of them (checked from its config before the weights are read), and ValueError naming the file
    when a local folder's ``config.json`` is not valid JSON or disagrees with its safetensors tensors.
    """
    from transformers import AutoModelForCausalLM

    path = os.fspath(path_or_hub_name)
    if not path.strip():
        resolve_model_path(path)  # the one-line refusal of an empty name
    if is_hub_name(path):
        path = os.fspath(fetch_hub_model(path, kwargs.pop("revision", None)))
    local = os.path.isdir(path)
    if local:
        kwargs.setdefault("local_files_only", True)
    config = load_config_checked(path, **{k: v for k, v in kwargs.items()
                                          if k in ("local_files_only", "revision", "trust_remote_code")})
    family_for(config)  # fail before loading weights
    if local:
        check_weights_match_config(path, config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model
