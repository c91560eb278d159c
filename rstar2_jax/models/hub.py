"""A model named by a local directory or by a Hugging Face hub id ("Qwen/Qwen3-0.6B", or
"Qwen/Qwen3-0.6B@<revision>"), resolved to a directory with huggingface_hub's cache.

Only what a run reads is fetched: the config, the tokenizer's files and the safetensors weights
(MODEL_FILES). Offline mode is honoured (HF_HUB_OFFLINE=1: the cache alone, no request made); a
model neither cached nor reachable is an error that says how to get it there. The environment
(HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME, HF_ENDPOINT) is read at each call, not when huggingface_hub
is imported.
"""

from __future__ import annotations

import os
import re

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "added_tokens.json", "chat_template.jinja", "chat_template.json"]
# owner/name, each as the hub allows (letters, digits, - _ .), optionally @revision
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


class ModelNotFound(ValueError):
    """A model path that is neither a model directory nor a hub id that can be had."""


def is_hub_id(path: str) -> bool:
    """A hub id, and not a path that exists here (a local "org/name" folder wins)."""
    return bool(path) and not os.path.exists(path) and HUB_ID.match(path) is not None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> str:
    """huggingface_hub's model cache, as its environment variables set it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                     "huggingface")
    return os.path.join(home, "hub")


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise ModelNotFound("hub model ids need huggingface_hub: pip install 'rstar2-jax[hub]' (or give a local "
                            "model directory)") from None
    return huggingface_hub


def model_directory(path: str, what: str = "model.path") -> str:
    """The local directory of the model `path` names: `path` itself when it is a model directory,
    else the hub id's snapshot in the cache (downloaded first unless offline)."""
    try:
        return _resolve(path)
    except ModelNotFound as e:
        raise ModelNotFound(f"{what}={path!r}: {e}") from None


def _resolve(path: str) -> str:
    """model_directory, its errors saying what is wrong without naming the setting."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFound("it is not a HF model directory (no config.json)")
        return path
    if not is_hub_id(path):
        raise ModelNotFound("no such directory, and not a Hugging Face hub id (owner/name)")
    m = HUB_ID.match(path)
    repo, revision = m["repo"], m["revision"]
    hub = _hub()
    from huggingface_hub import errors
    try:
        snapshot = hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir(), allow_patterns=MODEL_FILES,
                                         local_files_only=offline(), endpoint=os.environ.get("HF_ENDPOINT") or None)
    except errors.RepositoryNotFoundError:
        raise ModelNotFound("no directory of that name here, and no such model on the Hugging Face hub (or it is "
                            "private: log in with `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"the hub has no revision {revision!r} of {repo}") from None
    except (errors.LocalEntryNotFoundError, OSError) as e:
        where = "offline (HF_HUB_OFFLINE=1) it is not" if offline() else "the hub could not be reached and it is not"
        raise ModelNotFound(
            f"no directory of that name here; as a hub id, {where} in the Hugging Face cache {cache_dir()} "
            f"({type(e).__name__}). Download it where there is network (`hf download {repo}`) into this cache "
            "(HF_HUB_CACHE / HF_HOME), or give a local model directory") from None
    missing = [name for name in ("config.json",) if not os.path.isfile(os.path.join(snapshot, name))]
    if not any(f.endswith(".safetensors") for f in os.listdir(snapshot)):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFound(f"its snapshot {snapshot} lacks {', '.join(missing)} (an incomplete download: "
                            f"`hf download {repo}` again, or unset HF_HUB_OFFLINE)")
    return snapshot


def config_file(path: str, what: str = "model.path") -> str:
    """The model's config.json alone (for plans that need the architecture, not the weights)."""
    if os.path.isdir(path) or not is_hub_id(path):
        return os.path.join(model_directory(path, what), "config.json")
    m = HUB_ID.match(path)
    from huggingface_hub import errors
    try:
        return _hub().hf_hub_download(m["repo"], "config.json", revision=m["revision"], cache_dir=cache_dir(),
                                      local_files_only=offline(), endpoint=os.environ.get("HF_ENDPOINT") or None)
    except (errors.LocalEntryNotFoundError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError, OSError):
        return os.path.join(model_directory(path, what), "config.json")  # the same call's clear error


def check(path: str) -> str | None:
    """What is wrong with a model path, without downloading anything (for config checks): a
    directory without config.json, a string that is neither a directory nor a hub id, or a hub id
    that is not cached while offline. None when it may load (a hub id online is fetched at start)."""
    if not path or (is_hub_id(path) and not offline()):
        return None
    try:
        _resolve(path)
    except ModelNotFound as e:
        return f"{path!r}: {e}"
    return None
