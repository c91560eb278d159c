"""vLLM servers' kind (`rollout.engine=vllm`): generation on servers elsewhere (behind the
scheduler when there are several); the learner's weights reach them by the sync (files, pull or
NCCL), streamed from the learner's own arrays."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.shard_sizes import shard_sizes
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.vllm_engine.settings import VLLMSettings
from rstar2_jax.rollout.engines.engine_kind import (ENGINES, EngineKind, EnginePlanInputs, EngineWeights, PlanLine,
                                                    RolloutSection)
from rstar2_jax.rollout.engines.vllm_engine.sync.reach import default_sync_root, unreadable_by_servers
from rstar2_jax.rollout.engines.vllm_engine.modes import SYNC_WAYS, SyncWait



def _build_vllm(cfg: RolloutSection, model, tokenizer, seed: int) -> Engine:
    del tokenizer, seed  # the servers tokenize and seed per request
    from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
    from rstar2_jax.rollout.engines.scheduler import Scheduler
    v = cfg.vllm
    fetchers = v.fetch_urls or (None,) * len(v.urls)
    engines = [VLLMEngine(url, model, v, fetch_url=fetch) for url, fetch in zip(v.urls, fetchers)]
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
    # over several processes each tensor is gathered whole onto every device (sync/export.host_tensors)
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
