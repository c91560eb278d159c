"""The rollout settings (`rollout.*`) and the one way to build an engine from them, shared by
train, evaluate and chat.

ENGINES maps `rollout.engine` to an `EngineKind`: how to build that engine, how to check the
settings only it reads, and the facts the rest of the code needs about it (whether it runs in
the trainer's process, how it holds the learner's weights, what it adds to each device's memory,
how --plan names it). Nothing outside `rollout/engines/` compares an engine's name: it asks the
kind. Each kind is its own module (jax_kind.py, vllm_kind.py), registered by its import at the
end of this file; the engines themselves are imported when built, so choosing one never loads
the other (vLLM's client needs no JAX engine, and the reverse).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from rstar2_jax.config_types import Section, setting
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.registry import Registry
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.scheduler_policies import POLICIES


@dataclasses.dataclass(frozen=True)
class EngineWeights:
    """How an engine holds the learner's weights: the trainer hands them over accordingly and the
    memory plan counts them (one rule for both)."""
    streams_learner_arrays: bool = False  # a served engine's sync reads the learner's own arrays (no copy)
    dtype: str | None = None              # else a local copy in this dtype (None: the parameters' own)
    split: bool = False                   # ... split over the process's devices (engine_mesh), when several

    def shares(self, *, learner_devices: int, on_policy: bool) -> bool:
        """Whether the engine may use the learner's own arrays: it streams them, or a copy would
        equal them (float32 on the one device the learner and the engine both have) and nothing
        reads them during an update (on-policy: the engine is idle then; the update donates its
        buffers)."""
        if self.streams_learner_arrays:
            return True
        return self.dtype in (None, "float32") and learner_devices == 1 and on_policy


@dataclasses.dataclass(frozen=True)
class EnginePlanInputs:
    """What an engine's memory-plan lines are computed from (rl/memory_plan.py fills it)."""
    arch: ModelConfig
    rollout: RolloutConfig
    compute_dtype: str                 # model.dtype
    decode_attention: str              # model.decode_attention
    devices: int                       # the learner's devices, every process's
    devices_per_process: int
    learner_mesh: dict[str, int]       # the learner's (data, fsdp, tensor) sizes
    on_policy: bool                    # rl.max_staleness == 0


@dataclasses.dataclass(frozen=True)
class PlanLine:
    name: str
    bytes: float
    how: str


@dataclasses.dataclass(frozen=True)
class EngineKind:
    build: Callable[..., Engine]                                     # (rollout_cfg, model, tokenizer, seed) -> Engine
    check: Callable[[RolloutConfig], Iterable[tuple[str, str]]]      # (field, message) of each problem
    embedded: bool                                                   # in the trainer's process (it needs the model)
    samples_like_learner: Callable[[RolloutConfig, str], bool]       # (rollout, compute dtype): the float32 learner's numerics
    weights: Callable[[RolloutConfig, str], EngineWeights]           # (rollout, compute dtype)
    plan: Callable[[EnginePlanInputs], tuple[list[PlanLine], int]]   # its memory lines, and the devices it runs on
    describe: Callable[[RolloutConfig], str]                         # its one line in train --plan
    host_refusal: Callable[[RolloutConfig, str], str | None]         # (rollout, device platform): why it cannot run here


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


def engine_kind(cfg: RolloutConfig) -> EngineKind:
    return ENGINES[cfg.engine]


# Each kind registers itself (one import a kind).
from rstar2_jax.rollout.engines import jax_kind, vllm_kind  # noqa: E402, F401
