import os
import sys
from pathlib import Path

import pytest

# let test modules import shared helpers from each other (e.g. make_trace)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _private_expertcache_cache(tmp_path_factory):
    """Every test (and every subprocess it starts) uses a temporary expertcache cache folder
    ($EXPERTCACHE_CACHE: quantised expert sidecars, bench models), never the user's ~/.cache/expertcache."""
    path = tmp_path_factory.mktemp("expertcache-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPERTCACHE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module (tiny tensors: fastest, and immune to oversubscription on a busy
    machine); the previous count is restored afterwards. Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- data from outside the clone --------------------------------------------------------------------------------
# The real data sets (WikiText-2, MMLU, GSM8K, the training corpus) live in the shared data folder beside the
# checkout (``../shared/data``, or ``$EXPERTCACHE_DATA``), which only CI and the project's machines have. A test
# that needs them skips with a reason when they are absent (a fresh clone runs ``python -m pytest`` green); a
# test that only needs *some* data in the layout uses ``toy_data_dir`` (written by the package itself).

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("EXPERTCACHE_DATA") or REPO.parent / "shared" / "data")


def needs_shared_data(*subfolders: str):
    """Mark: skip (with the reason) unless ``SHARED_DATA/<sub>`` exists for every named sub-folder."""
    missing = [s for s in subfolders if not (SHARED_DATA / s).is_dir()]
    return pytest.mark.skipif(bool(missing), reason="needs the shared data folder: no "
                              f"{', '.join(m + '/' for m in missing)} under {SHARED_DATA} (set EXPERTCACHE_DATA)")


def shared_data(subfolder: str) -> Path:
    """``SHARED_DATA/<subfolder>``, or skip the calling test with the reason when it is absent."""
    path = SHARED_DATA / subfolder
    if not path.is_dir():
        pytest.skip(f"needs the shared data folder: {path} does not exist (set EXPERTCACHE_DATA)")
    return path


@pytest.fixture(scope="session")
def toy_data_dir(tmp_path_factory) -> str:
    """A data folder in the shared layout (WikiText-2, MMLU, GSM8K) with toy rows, for tests that need a data
    folder to exist but do not test the real data sets."""
    from expertcache.eval.synthetic import write_toy_data

    return str(write_toy_data(tmp_path_factory.mktemp("toy-data")))


def decode_logits(rt, ids_BS, prefill: int = 1):
    """Logits [B, S, V] of every position of ``ids_BS`` through a runtime (an ``OffloadedModel``): a prefill of
    ``prefill`` tokens into a fresh KV cache, then the rest teacher-forced, one token per forward."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        out = rt.forward(ids_BS[:, :prefill], DynamicCache(config=rt.config))
        logits, past = [out.logits], out.past_key_values
        for t in range(prefill, ids_BS.shape[1]):
            out = rt.forward(ids_BS[:, t:t + 1], past)
            logits.append(out.logits)
            past = out.past_key_values
    return torch.cat(logits, dim=1)


def save_decisive_olmoe(path, layers: int, experts: int, top_k: int):
    """A tiny OLMoE (``layers`` layers, ``experts`` experts, top-``top_k``, float32, seed 0) saved to ``path``, its
    router weights redrawn at scale D^-1/2 so routing is decisive (as models/tiny.py does) and the cache-aware
    policies change choices; returns ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from expertcache.models.tiny import tiny_config

    cfg = tiny_config("olmoe")
    cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok = layers, experts, top_k
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, cfg.hidden_size ** -0.5)
    model.save_pretrained(path)
    return path
