"""The rollout settings (`rollout.*`) and the one way to build an engine from them, shared by
train, evaluate and chat.

ENGINES maps `rollout.engine` to an `EngineKind`: how to build that engine from a RolloutConfig
and how to check the settings only it reads. Engine modules are imported when built, so choosing
one never loads the other (vLLM's client needs no JAX engine, and the reverse).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable
from urllib.parse import urlsplit

from rstar2_jax.config_types import Section, setting
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.registry import Registry
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.reach import default_sync_root, unreadable_by_servers
from rstar2_jax.rollout.scheduler_policies import POLICIES


@dataclasses.dataclass(frozen=True)
class EngineKind:
    build: Callable[..., Engine]                               # (rollout_cfg, model, tokenizer, seed) -> Engine
    check: Callable[["RolloutConfig"], Iterable[tuple[str, str]]]  # (field, message) of each problem


ENGINES: Registry[EngineKind] = Registry("engine")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    slots: int = setting(32, "jax engine: sequences decoded together", min=1)
    max_len: int = setting(640, "KV per sequence: the longest prompt + every stage's max_response_tokens must fit",
                           min=2)
    temperature: float = setting(1.0, "sampling temperature of training rollouts (0: greedy)", min=0.0)
    tool_timeout_s: float = setting(5.0, "seconds a tool call may run", min=0.001)
    engine: str = setting("jax", "jax (embedded in the learner process) | vllm (servers at vllm_urls)",
                          choices=ENGINES)
    reuse_kv: bool = setting(False, "jax: keep a trajectory's KV between turns (prefill only new tokens)")
    page_size: int = setting(0, "jax: 0 = one max_len KV row per slot; N = paged KV, pages of N positions", min=0)
    kv_pages: int = setting(0, "jax, paged: pages in the pool (0 = kv_memory_gb's, else slots x max_len / "
                            "page_size)", min=0)
    kv_memory_gb: float = setting(0.0, "jax, paged: the KV pool's size in GiB, all the engine's devices together "
                                  "(0 = kv_pages); the pool holds as many pages as fit", min=0.0)
    vllm_urls: tuple[str, ...] = setting((), "vllm: server URLs (repeat --config.rollout.vllm_urls=URL); "
                                         "several go behind the scheduler")
    scheduler: str = setting("kv_aware", "policy over several vLLM servers", choices=POLICIES)
    vllm_export_dtype: str = setting("", "vllm: dtype of synced weights ('' = the params'; bfloat16 for bf16 "
                                     "servers)", choices=("", *DTYPES))
    vllm_probe_tolerance: float = setting(1e-3, "vllm: max |log-prob| gap server vs learner after a sync "
                                          "(raise for bf16)", min=0.0)
    vllm_sync: str = setting("files", "vllm: how synced weights reach the servers: files (they read the export "
                             "from vllm_sync_dir) | pull (the weight fetcher beside each server copies it over "
                             "HTTP: no shared filesystem) | nccl (GPU broadcast; untested without GPUs)",
                             choices=("files", "pull", "nccl"))
    vllm_sync_dir: str = setting("", "vllm: where synced weights are written ('' = this host's /dev/shm; with "
                                 "sync=files, servers on other hosts need a shared filesystem path)")
    vllm_fetch_urls: tuple[str, ...] = setting((), "vllm, sync=pull: the weight fetcher beside each server, in "
                                               "vllm_urls order (python -m rstar2_jax.rollout.serve --fetch_port)")
    vllm_sync_bucket_mb: float = setting(2048.0, "vllm: the weight sync's bucket (MiB of whole decoder layers, in "
                                         "host memory): each server reloads one bucket while the next is written; "
                                         "each reload has a fixed cost (BENCHMARKS.md 'vLLM weight sync'); a "
                                         "fraction of a MiB splits a tiny model", min=1e-6)
    vllm_sync_host: str = setting("127.0.0.1", "vllm, sync=pull: the address the fetchers reach this trainer at",
                                  nonempty=True)

    def rules(self):
        if self.engine in ENGINES:
            yield from ENGINES[self.engine].check(self)


def make_engine(cfg: RolloutConfig, model, tokenizer, *, seed: int) -> Engine:
    """The engine `cfg.engine` names. `model`: the embedded engine's model; for vLLM the served
    architecture, used to export and probe synced weights (None: generation only, no sync)."""
    return ENGINES[cfg.engine].build(cfg, model, tokenizer, seed)


def engine_mesh(decode_attention: str, devices=None):
    """The embedded engine's devices: this process's, all on the tensor axis (weights and KV heads
    split over them, as vLLM's tensor parallelism). None (one device) when there is one, or with
    the Pallas decode kernel, which runs on a single device."""
    import jax
    devices = jax.local_devices() if devices is None else list(devices)
    if len(devices) == 1 or decode_attention == "pallas":
        return None
    from rstar2_jax.sharding import make_mesh
    return make_mesh(data=1, fsdp=1, tensor=len(devices), devices=devices)


def kv_pool_pages(cfg: RolloutConfig, model_cfg, dtype_bytes: int) -> int | None:
    """Pages of the embedded engine's paged KV pool: kv_pages, or what kv_memory_gb holds (None:
    unpaged, or slots x max_len's worth)."""
    from rstar2_jax.rollout.engines.kv_pages import kv_bytes_per_position, pages_in_budget
    if cfg.kv_pages or not cfg.kv_memory_gb:
        return cfg.kv_pages or None
    position = kv_bytes_per_position(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, dtype_bytes)
    pages = pages_in_budget(cfg.kv_memory_gb * 2**30, cfg.page_size, position)
    if pages * cfg.page_size < cfg.max_len:
        raise ValueError(f"rollout.kv_memory_gb={cfg.kv_memory_gb} holds {pages} page(s) of {cfg.page_size} positions "
                         f"({position} bytes each), fewer than one rollout.max_len={cfg.max_len} sequence")
    return pages


# ----------------------------------------------------------------------------------------------
def _build_jax(cfg: RolloutConfig, model, tokenizer, seed: int) -> Engine:
    import jax.numpy as jnp

    from rstar2_jax.rollout.engines.jax_engine import JaxEngine
    return JaxEngine(model, tokenizer, slots=cfg.slots, max_len=cfg.max_len, seed=seed, reuse_kv=cfg.reuse_kv,
                     page_size=cfg.page_size or None,
                     kv_pages=kv_pool_pages(cfg, model.cfg, jnp.dtype(model.dtype).itemsize),
                     mesh=engine_mesh(model.decode_attention))


def _check_jax(cfg: RolloutConfig):
    if cfg.page_size and cfg.max_len % cfg.page_size:
        yield "page_size", f"{cfg.page_size} must divide rollout.max_len={cfg.max_len}"
    if cfg.kv_pages and not cfg.page_size:
        yield "kv_pages", "needs rollout.page_size > 0 (kv_pages sizes the paged KV pool)"
    if cfg.kv_memory_gb and not cfg.page_size:
        yield "kv_memory_gb", "needs rollout.page_size > 0 (it sizes the paged KV pool)"
    if cfg.kv_memory_gb and cfg.kv_pages:
        yield "kv_memory_gb", "and rollout.kv_pages both size the pool: set one (the other 0)"
    if cfg.kv_pages and cfg.page_size and cfg.kv_pages * cfg.page_size < cfg.max_len:
        yield "kv_pages", (f"{cfg.kv_pages} x page_size={cfg.page_size} cannot hold one max_len={cfg.max_len} "
                           "sequence")


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


ENGINES.register("jax", EngineKind(_build_jax, _check_jax))
ENGINES.register("vllm", EngineKind(_build_vllm, _check_vllm))
