"""``--model owner/name``: a hub name is fetched through huggingface_hub (or its local cache); offline and not
cached it is one clear line, exit code 2. Nothing here touches the network (HF_HUB_OFFLINE=1, private HF_HOME)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _cli(tmp_path, *argv):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1",
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "nobody/no-such-moe", "--max-new-tokens", "1", "hello"],
    ["eval", "--model", "nobody/no-such-moe", "--task", "wikitext", "--limit", "1", "--data-dir", "{data}"],
])
def test_offline_hub_name_is_one_clear_line(tmp_path, toy_data_dir, argv):
    proc = _cli(tmp_path, *[a.replace("{data}", toy_data_dir) for a in argv])  # data found: the model is the culprit
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if ": error: " in line]  # config line may precede
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'nobody/no-such-moe' is not a local folder" in lines[0] and "hub is unreachable" in lines[0]


def test_hub_name_served_from_the_local_hub_cache(tmp_path):
    """A model in the hub cache (as snapshot_download leaves it) runs by its hub name, offline."""
    from expertcache.assets import shipped_model_dir

    repo = tmp_path / "hf" / "hub" / "models--someone--granular-copy"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(shipped_model_dir("granular"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    proc = _cli(tmp_path, "generate", "--model", "someone/granular-copy", "--max-new-tokens", "3", "--json", "The")
    assert proc.returncode == 0, proc.stderr
    assert '"model"' in proc.stderr and "granular-copy" in proc.stderr


def test_is_hub_name():
    from expertcache.models.loader import is_hub_name

    assert is_hub_name("allenai/OLMoE-1B-7B-0924") and is_hub_name("mistralai/Mixtral-8x7B-v0.1")
    assert not is_hub_name("granular") and not is_hub_name("/abs/path") and not is_hub_name("a/b/c")
    assert not is_hub_name("../x") and not is_hub_name("./x") and not is_hub_name(SRC)
