"""`rollout.vllm.*`: the vLLM engine's settings, in one place for the config check (kind.py) and
the engine (engine.py: `vllm_settings` reads a section with overrides by name)."""

from __future__ import annotations

import dataclasses
import typing

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.rollout.engines.scheduler_policies import POLICIES
from rstar2_jax.rollout.engines.vllm_engine.modes import SYNC_WAYS, Probe, Reload, SyncWait, names


@dataclasses.dataclass(frozen=True)
class VLLMSettings(Section):
    """`rollout.vllm.*`: the servers, the scheduler over them, and how synced weights reach them."""
    # `swap` meant this and, under rollout.jax, when new weights take over: one name, one meaning (issue 82)
    moved: typing.ClassVar[dict[str, str]] = {"swap": "reload"}
    urls: tuple[str, ...] = setting((), "server URLs (repeat --config.rollout.vllm.urls=URL); several go behind "
                                    "the scheduler")
    scheduler: str = setting("kv_aware", "policy over several servers", choices=POLICIES)
    export_dtype: str = setting("", "dtype of synced weights ('' = the params'; bfloat16 for bf16 servers)",
                                choices=("", *DTYPES))
    probe_tolerance: float = setting(1e-3, "max |log-prob| gap server vs learner after a sync (raise for bf16)",
                                     min=0.0)
    sync: str = setting("files", "how synced weights reach the servers: files (they read the export from "
                        "sync_dir) | pull (the weight fetcher beside each server copies it over HTTP: no shared "
                        "filesystem) | nccl (GPU broadcast; untested without GPUs)", choices=SYNC_WAYS)
    sync_dir: str = setting("", "where synced weights are written ('' = this host's /dev/shm; with sync=files, "
                            "servers on other hosts need a shared filesystem path)")
    fetch_urls: tuple[str, ...] = setting((), "sync=pull: the weight fetcher beside each server, in urls order "
                                          "(python -m rstar2_jax.rollout.serve --fetch_port)")
    sync_bucket_mb: float = setting(2048.0, "the weight sync's bucket (MiB of whole decoder layers, in host "
                                    "memory): each server reloads one bucket while the next is written; each "
                                    "reload has a fixed cost (BENCHMARKS.md 'vLLM weight sync'); a fraction of a "
                                    "MiB splits a tiny model", min=1e-6)
    sync_host: str = setting("127.0.0.1", "sync=pull: the address the fetchers reach this trainer at",
                             nonempty=True)
    reload: str = setting("staged", "staged: the servers generate while every bucket is written (and fetched), then "
                        "each stops only for one reload of the whole export | streamed: each bucket reloaded while "
                        "the next is written (shorter syncs where servers have cores of their own, longer pauses)",
                        choices=names(Reload))
    sync_wait: str = setting("reload", "what the trainer waits for at each sync: reload (every server holds the new "
                             "weights) | export (only the export: the servers' reload lands beside the next update, "
                             "and the next step's rollouts wait for it)", choices=names(SyncWait))
    probe: str = setting("deferred", "deferred: the log-prob probe after each sync runs beside the next rollouts and "
                         "a mismatch stops the run at the next sync | wait: the trainer waits for it every sync",
                         choices=names(Probe))


def vllm_settings(settings: VLLMSettings | None, overrides: dict) -> VLLMSettings:
    """`settings` (default: the section's defaults) with `overrides` by field name (None: the
    section's value; export_dtype may be a dtype), checked as the config is (ConfigValueError)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "export_dtype" in overrides and not isinstance(overrides["export_dtype"], str):
        dtype = overrides["export_dtype"]
        names = [name for name, known in DTYPES.items() if known == dtype]
        if not names:
            raise ValueError(f"export_dtype {dtype!r} is none of {', '.join(DTYPES)}")
        overrides["export_dtype"] = names[0]
    return VLLMSettings.from_mapping({**(settings or VLLMSettings()).to_dict(), **overrides})
