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
