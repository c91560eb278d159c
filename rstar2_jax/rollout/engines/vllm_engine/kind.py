"""vLLM servers' kind (`rollout.engine=vllm`): generation on servers elsewhere (behind the
scheduler when there are several); the learner's weights reach them by the sync (files, pull or
NCCL), streamed from the learner's own arrays."""

from __future__ import annotations

import dataclasses
import os
import typing
from urllib.parse import urlsplit

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.shard_sizes import shard_sizes
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.engine_kind import (ENGINES, EngineKind, EnginePlanInputs, EngineWeights, PlanLine,
                                                    RolloutSection)
from rstar2_jax.rollout.engines.vllm_engine.sync.reach import default_sync_root, unreadable_by_servers
from rstar2_jax.rollout.engines.vllm_engine.modes import SYNC_WAYS, Probe, Reload, SyncWait, names
from rstar2_jax.rollout.engines.scheduler_policies import POLICIES



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


def _build_vllm(cfg: RolloutSection, model, tokenizer, seed: int) -> Engine:
    del tokenizer, seed  # the servers tokenize and seed per request
    from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
    from rstar2_jax.rollout.engines.scheduler import Scheduler
    v = cfg.vllm
    export_dtype = DTYPES[v.export_dtype] if v.export_dtype else None
    fetchers = cfg.vllm.fetch_urls or (None,) * len(cfg.vllm.urls)
    engines = [VLLMEngine(url, model, export_dtype=export_dtype, probe_tolerance=cfg.vllm.probe_tolerance,
                          sync_dir=v.sync_dir or None, sync=v.sync, fetch_url=fetch, sync_host=v.sync_host,
                          bucket_bytes=max(1, int(v.sync_bucket_mb * 2**20)), reload=v.reload, probe=v.probe,
                          sync_wait=v.sync_wait)
               for url, fetch in zip(v.urls, fetchers)]
    return engines[0] if len(engines) == 1 else Scheduler(engines, cfg.vllm.scheduler)


def _check_vllm(cfg: RolloutSection):
    if not cfg.vllm.urls:
        yield "vllm.urls", ("rollout.engine=vllm needs the server URLs (start one with "
                            "`python -m rstar2_jax.rollout.serve --model DIR`)")
    for i, url in enumerate(cfg.vllm.urls):
        if not url.startswith(("http://", "https://")):
            yield f"vllm.urls[{i}]", f"must be an http(s) URL, got {url!r}"
    way = SYNC_WAYS[cfg.vllm.sync]
    if way.needs_fetcher and len(cfg.vllm.fetch_urls) != len(cfg.vllm.urls):
        yield "vllm.fetch_urls", (f"sync=pull needs one weight fetcher URL per server ({len(cfg.vllm.urls)}), got "
                                  f"{len(cfg.vllm.fetch_urls)}")
    if not way.writes_export and SyncWait(cfg.vllm.sync_wait).in_background:
        yield "vllm.sync_wait", ("export needs a sync through files (rollout.vllm.sync=files or pull): an NCCL "
                                 "broadcast is the servers' load itself; set sync_wait=reload")
    if not way.needs_fetcher and cfg.vllm.fetch_urls:
        yield "vllm.fetch_urls", "are only read with rollout.vllm.sync=pull"
    for i, url in enumerate(cfg.vllm.fetch_urls):
        if not url.startswith(("http://", "https://")):
            yield f"vllm.fetch_urls[{i}]", f"must be an http(s) URL, got {url!r}"
    if cfg.vllm.sync_dir and not (os.path.isdir(cfg.vllm.sync_dir) and os.access(cfg.vllm.sync_dir, os.W_OK)):
        yield "vllm.sync_dir", f"{cfg.vllm.sync_dir!r} is not a writable directory (the servers read synced weights there)"
    elif way.servers_read_export:
        why = unreadable_by_servers([urlsplit(u).hostname or "" for u in cfg.vllm.urls],
                                    cfg.vllm.sync_dir or default_sync_root())
        if why:
            yield "vllm.sync", (f"files: {why}. Set rollout.vllm.sync=pull (a weight fetcher beside each server: "
                                "python -m rstar2_jax.rollout.serve --fetch_port PORT, its URL in "
                                "rollout.vllm.fetch_urls), or rollout.vllm.sync_dir to a path on a filesystem the "
                                "servers' hosts mount too")


def _weights(cfg: RolloutSection, compute_dtype: str) -> EngineWeights:
    if not SYNC_WAYS[cfg.vllm.sync].writes_export:  # broadcast from one whole local copy on the first device
        return EngineWeights()
    # streamed to the servers tensor by tensor from the learner's own arrays (vllm_engine/sync/export.py; split
    # over processes, each tensor is gathered by all), which the sync is done with before the next
    # update donates them
    return EngineWeights(streams_learner_arrays=True)


def _plan(x: EnginePlanInputs) -> tuple[list[PlanLine], int]:
    return [PlanLine("engine weights", 0.0, "rollouts run on vLLM servers"), PlanLine("KV pool", 0.0, "on the servers"),
            PlanLine("weight sync", *_sync_window(x), "rollout.vllm.export_dtype=bfloat16 (half the bytes), or one "
                     "trainer process per host (the tensors then stay split over its devices)")], 1


def _sync_window(x: EnginePlanInputs) -> tuple[float, str]:
    """What the vLLM weight sync holds on one device beyond the learner's state."""
    import jax.numpy as jnp

    r = x.rollout
    if not SYNC_WAYS[r.vllm.sync].writes_export:
        from rstar2_jax.models.flops import param_count
        return float(param_count(x.arch) * 4), "NCCL: a whole float32 copy on each process's first device"
    dtype = jnp.dtype(DTYPES[r.vllm.export_dtype] if r.vllm.export_dtype else jnp.float32)
    processes = x.devices // x.devices_per_process
    # over several processes each tensor is gathered whole onto every device (weight_export.host_tensors)
    whole = processes > 1
    sizes = sorted(shard_sizes(x.arch, {"data": 1, "fsdp": 1, "tensor": 1} if whole else x.learner_mesh))
    how = f"whole (gathered over {processes} processes)" if whole else \
        f"split like the parameters (its {r.vllm.sync_bucket_mb:g} MiB buckets are host memory)"
    return float(sum(sizes[-2:]) * dtype.itemsize), f"the export's two largest tensors in {dtype.name}, {how}"


def _adapter_refusal(r: RolloutSection, rank: int) -> str | None:
    if not SYNC_WAYS[r.vllm.sync].carries_adapters:
        return ("LoRA adapters reach vLLM servers by files or pull, not rollout.vllm.sync=nccl (a broadcast of the "
                "whole model): set rollout.vllm.sync=files or pull (the adapters are megabytes), or "
                "model.lora.rank=0")
    if SyncWait(r.vllm.sync_wait).in_background:
        return ("a LoRA run's sync moves only the adapters (megabytes) and is always waited for: set "
                "rollout.vllm.sync_wait=reload, or model.lora.rank=0")
    if rank > 512:
        return f"vLLM serves LoRA adapters up to rank 512, not {rank}: lower model.lora.rank"
    return None


def _host_refusal(r: RolloutSection, platform: str) -> str | None:
    if SYNC_WAYS[r.vllm.sync].needs_gpu and platform != "gpu":
        return (f"rollout.vllm.sync=nccl broadcasts the weights from the learner's GPUs, but this host's devices are "
                f"{platform}: use rollout.vllm.sync=files (servers that read this host's /dev/shm or a shared "
                "rollout.vllm.sync_dir) or rollout.vllm.sync=pull (a weight fetcher beside each server)")
    return None


ENGINES.register("vllm", EngineKind(
    build=_build_vllm, settings=VLLMSettings, check=_check_vllm, embedded=False,
    samples_like_learner=lambda r, compute_dtype: False,  # other kernels, whatever the dtype
    weights=_weights, plan=_plan,
    describe=lambda r: f"vllm, {len(r.vllm.urls)} server(s), scheduler {r.vllm.scheduler}",
    host_refusal=_host_refusal, adapter_refusal=_adapter_refusal,
    lands_in_background=lambda r: SyncWait(r.vllm.sync_wait).in_background,
    # where the servers are and how weights reach them: what a resumed run may move
    resumable=("urls", "sync", "sync_dir", "fetch_urls", "sync_host", "sync_bucket_mb"),
    cli_flags=(("url", "urls"), ("scheduler", "scheduler"))))
