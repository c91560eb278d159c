"""vLLM servers' kind (`rollout.engine=vllm`): generation on servers elsewhere (behind the
scheduler when there are several); the learner's weights reach them by the sync (files, pull or
NCCL), streamed from the learner's own arrays."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.shard_sizes import shard_sizes
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.factory import (ENGINES, EngineKind, EnginePlanInputs, EngineWeights, PlanLine,
                                                RolloutConfig)
from rstar2_jax.rollout.engines.reach import default_sync_root, unreadable_by_servers


def _build_vllm(cfg: RolloutConfig, model, tokenizer, seed: int) -> Engine:
    del tokenizer, seed  # the servers tokenize and seed per request
    from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine
    from rstar2_jax.rollout.scheduler import Scheduler
    export_dtype = DTYPES[cfg.vllm_export_dtype] if cfg.vllm_export_dtype else None
    fetchers = cfg.vllm_fetch_urls or (None,) * len(cfg.vllm_urls)
    engines = [VLLMEngine(url, model, export_dtype=export_dtype, probe_tolerance=cfg.vllm_probe_tolerance,
                          sync_dir=cfg.vllm_sync_dir or None, sync=cfg.vllm_sync, fetch_url=fetch, sync_host=cfg.vllm_sync_host,
                          bucket_bytes=max(1, int(cfg.vllm_sync_bucket_mb * 2**20)))
               for url, fetch in zip(cfg.vllm_urls, fetchers)]
    return engines[0] if len(engines) == 1 else Scheduler(engines, cfg.scheduler)


def _check_vllm(cfg: RolloutConfig):
    if not cfg.vllm_urls:
        yield "vllm_urls", ("rollout.engine=vllm needs the server URLs (start one with "
                            "`python -m rstar2_jax.rollout.serve --model DIR`)")
    for i, url in enumerate(cfg.vllm_urls):
        if not url.startswith(("http://", "https://")):
            yield f"vllm_urls[{i}]", f"must be an http(s) URL, got {url!r}"
    if cfg.page_size or cfg.kv_pages or cfg.kv_memory_gb:
        yield "page_size", ("pages the embedded engine's KV (rollout.engine=jax); vLLM servers page their own "
                            "(--block-size)")
    if cfg.reuse_kv:
        yield "reuse_kv", "is the embedded engine's; vLLM servers reuse KV by their prefix cache"
    if cfg.vllm_sync == "pull" and len(cfg.vllm_fetch_urls) != len(cfg.vllm_urls):
        yield "vllm_fetch_urls", (f"sync=pull needs one weight fetcher URL per server ({len(cfg.vllm_urls)}), got "
                                  f"{len(cfg.vllm_fetch_urls)}")
    if cfg.vllm_sync != "pull" and cfg.vllm_fetch_urls:
        yield "vllm_fetch_urls", "are only read with rollout.vllm_sync=pull"
    for i, url in enumerate(cfg.vllm_fetch_urls):
        if not url.startswith(("http://", "https://")):
            yield f"vllm_fetch_urls[{i}]", f"must be an http(s) URL, got {url!r}"
    if cfg.vllm_sync_dir and not (os.path.isdir(cfg.vllm_sync_dir) and os.access(cfg.vllm_sync_dir, os.W_OK)):
        yield "vllm_sync_dir", f"{cfg.vllm_sync_dir!r} is not a writable directory (the servers read synced weights there)"
    elif cfg.vllm_sync == "files":
        why = unreadable_by_servers([urlsplit(u).hostname or "" for u in cfg.vllm_urls],
                                    cfg.vllm_sync_dir or default_sync_root())
        if why:
            yield "vllm_sync", (f"files: {why}. Set rollout.vllm_sync=pull (a weight fetcher beside each server: "
                                "python -m rstar2_jax.rollout.serve --fetch_port PORT, its URL in "
                                "rollout.vllm_fetch_urls), or rollout.vllm_sync_dir to a path on a filesystem the "
                                "servers' hosts mount too")


def _weights(cfg: RolloutConfig, compute_dtype: str) -> EngineWeights:
    if cfg.vllm_sync == "nccl":  # broadcast from one whole local copy on the process's first device
        return EngineWeights()
    # streamed to the servers tensor by tensor from the learner's own arrays (weight_export.py; split
    # over processes, each tensor is gathered by all), which the sync is done with before the next
    # update donates them
    return EngineWeights(streams_learner_arrays=True)


def _plan(x: EnginePlanInputs) -> tuple[list[PlanLine], int]:
    return [PlanLine("engine weights", 0.0, "rollouts run on vLLM servers"), PlanLine("KV pool", 0.0, "on the servers"),
            PlanLine("weight sync", *_sync_window(x))], 1


def _sync_window(x: EnginePlanInputs) -> tuple[float, str]:
    """What the vLLM weight sync holds on one device beyond the learner's state."""
    import jax.numpy as jnp

    r = x.rollout
    if r.vllm_sync == "nccl":
        from rstar2_jax.models.flops import param_count
        return float(param_count(x.arch) * 4), "NCCL: a whole float32 copy on each process's first device"
    dtype = jnp.dtype(DTYPES[r.vllm_export_dtype] if r.vllm_export_dtype else jnp.float32)
    processes = x.devices // x.devices_per_process
    # over several processes each tensor is gathered whole onto every device (weight_export.host_tensors)
    whole = processes > 1
    sizes = sorted(shard_sizes(x.arch, {"data": 1, "fsdp": 1, "tensor": 1} if whole else x.learner_mesh))
    how = f"whole (gathered over {processes} processes)" if whole else \
        f"split like the parameters (its {r.vllm_sync_bucket_mb:g} MiB buckets are host memory)"
    return float(sum(sizes[-2:]) * dtype.itemsize), f"the export's two largest tensors in {dtype.name}, {how}"


def _host_refusal(r: RolloutConfig, platform: str) -> str | None:
    if r.vllm_sync == "nccl" and platform != "gpu":
        return (f"rollout.vllm_sync=nccl broadcasts the weights from the learner's GPUs, but this host's devices are "
                f"{platform}: use rollout.vllm_sync=files (servers that read this host's /dev/shm or a shared "
                "rollout.vllm_sync_dir) or rollout.vllm_sync=pull (a weight fetcher beside each server)")
    return None


ENGINES.register("vllm", EngineKind(
    build=_build_vllm, check=_check_vllm, embedded=False,
    samples_like_learner=lambda r, compute_dtype: False,  # other kernels, whatever the dtype
    weights=_weights, plan=_plan,
    describe=lambda r: f"vllm, {len(r.vllm_urls)} server(s), scheduler {r.scheduler}",
    host_refusal=_host_refusal))
