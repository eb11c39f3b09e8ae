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
