"""Models named by Hugging Face hub ids, read through a huggingface_hub cache (issue 39).

No network here: each test populates a cache in huggingface_hub's own layout
(models--owner--name/refs/main -> commit, snapshots/<commit>/files) with the tiny model, and points
HF_HUB_CACHE at it; "the hub cannot be reached" is HF_ENDPOINT at a closed loopback port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from rstar2_jax.models.hub import ModelNotFound, check, model_directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "test-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache, model_dir, repo=REPO, commit=COMMIT):
    """The cache huggingface_hub writes for `repo` at `commit` (blobs by content, snapshot links)."""
    folder = os.path.join(cache, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(commit)
    snapshot = os.path.join(folder, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(folder, "blobs"))
    for name in os.listdir(model_dir):
        blob = os.path.join(folder, "blobs", f"blob-{name}")
        shutil.copy(os.path.join(model_dir, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    return snapshot


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


@pytest.fixture
def hub_env(tmp_path, monkeypatch, tiny_dir):
    cache = str(tmp_path / "hub")
    snapshot = populate_cache(cache, tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snapshot


def test_a_cached_hub_id_resolves_offline_to_its_snapshot_and_loads(hub_env):
    from rstar2_jax import models
    from rstar2_jax.models.tokenizer import Tokenizer
    _, snapshot = hub_env
    assert model_directory(REPO) == snapshot
    assert model_directory(f"{REPO}@{COMMIT}") == snapshot  # a pinned revision
    model = models.load_pretrained(model_directory(REPO))
    assert model.cfg.num_layers >= 1
    assert Tokenizer.from_pretrained(snapshot).encode("2+2")
    assert check(REPO) is None


def test_an_uncached_id_offline_says_how_to_get_it_and_config_checks_refuse_it(hub_env):
    from rstar2_jax.core.config_types import ConfigValueError
    from rstar2_jax.rl.config import RunConfig, base_config
    with pytest.raises(ModelNotFound, match=r"model.path='test-org/absent': no directory of that name here; as a hub "
                                            r"id, offline \(HF_HUB_OFFLINE=1\).*hf download test-org/absent"):
        model_directory("test-org/absent")
    tree = base_config().to_dict()
    tree["model"]["path"] = "test-org/absent"
    with pytest.raises(ConfigValueError, match=r"model.path: 'test-org/absent': no directory of that name here; as a "
                                               r"hub id, offline"):
        RunConfig.from_config(tree)
    tree["model"]["path"] = REPO
    assert RunConfig.from_config(tree).model.path == REPO
    tree["model"]["path"] = "not a path or id"
    with pytest.raises(ConfigValueError, match=r"model.path: 'not a path or id': no such directory, and not a "
                                               r"Hugging Face hub id"):
        RunConfig.from_config(tree)


def test_an_unreachable_hub_falls_back_to_the_cache_and_names_the_cache_when_absent(hub_env, monkeypatch):
    _, snapshot = hub_env
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert model_directory(REPO) == snapshot
    with pytest.raises(ModelNotFound, match=r"the hub could not be reached and it is not in the Hugging Face cache"):
        model_directory("test-org/absent")


def test_the_plan_resolves_a_hub_id_as_the_run_does(hub_env, monkeypatch, tmp_path):
    """`train --plan` reads the architecture through the same resolution as the run: a cached id
    with the hub unreachable is planned from the cache; an id neither cached nor reachable is the
    run's ModelNotFound (the CLI prints it without a traceback), not a FileNotFoundError."""
    from rstar2_jax.rl.config import RunConfig, base_config
    from rstar2_jax.rl.plan import describe_plan
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    # huggingface_hub retries a refused connection for a file it has not cached, with back-off (23 s
    # here, once the hub's client exists); what is tested is our answer to the error, not its waits
    from huggingface_hub import file_download
    monkeypatch.setattr(file_download, "_DEFAULT_RETRY_ON_EXCEPTIONS", (), raising=False)
    tree = base_config().to_dict()
    tree["model"]["path"] = REPO
    assert f"model: {REPO}: qwen3, " in describe_plan(RunConfig.from_config(tree), str(tmp_path / "run"))
    tree["model"]["path"] = "test-org/absent"
    with pytest.raises(ModelNotFound, match=r"model.path='test-org/absent': .*the hub could not be reached"):
        describe_plan(RunConfig.from_config(tree), str(tmp_path / "run"))


def test_an_incomplete_snapshot_is_refused(hub_env):
    _, snapshot = hub_env
    for name in os.listdir(snapshot):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(snapshot, name))
    with pytest.raises(ModelNotFound, match=r"lacks \*.safetensors"):
        model_directory(REPO)


def test_the_chat_cli_takes_a_hub_id(hub_env):
    cache, _ = hub_env
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.chat", "--model", REPO, "--format", "compact",
                           "--max_tokens", "16", "--max_turns", "1", "--prompt", "What is 2+2?", "--temperature", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "rstar2_jax.chat", "--model", "test-org/absent", "--prompt", "x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "hf download test-org/absent" in bad.stderr
    assert "Traceback" not in bad.stderr
