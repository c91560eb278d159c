"""The rollout settings (`rollout.*`) and the one way to build an engine from them, shared by
train, evaluate and chat.

ENGINES maps `rollout.engine` to an `EngineKind`: how to build that engine, its own settings
section (`rollout.<kind>.*`, part_sections.py) and how to check them, and the facts the rest of
the code needs about it (whether it runs in the trainer's process, how it holds the learner's
weights, what it adds to each device's memory, how --plan names it). Nothing outside
`rollout/engines/` compares an engine's name: it asks the kind. Each kind is its own module
(jax_kind.py, vllm_kind.py), registered by its import at the end of this file; the engines
themselves are imported when built, so choosing one never loads the other (vLLM's client needs
no JAX engine, and the reverse).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from rstar2_jax.config_types import Section, setting
from rstar2_jax.part_sections import PartChoice, part_section
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.registry import Registry
from rstar2_jax.rollout.engines.base import Engine


@dataclasses.dataclass(frozen=True)
class EngineWeights:
    """How an engine holds the learner's weights: the trainer hands them over accordingly and the
    memory plan counts them (one rule for both)."""
    streams_learner_arrays: bool = False  # a served engine's sync reads the learner's own arrays (no copy)
    dtype: str | None = None              # else a local copy in this dtype (None: the parameters' own)
    split: bool = False                   # ... split over the process's devices (engine_mesh), when several
    own_devices: bool = False             # on devices of its own (never the learner's arrays)

    def shares(self, *, learner_devices: int, on_policy: bool) -> bool:
        """Whether the engine may use the learner's own arrays: it streams them, or a copy would
        equal them (float32 on the one device the learner and the engine both have) and nothing
        reads them during an update (on-policy: the engine is idle then; the update donates its
        buffers)."""
        if self.streams_learner_arrays:
            return True
        return not self.own_devices and self.dtype in (None, "float32") and learner_devices == 1 and on_policy


@dataclasses.dataclass(frozen=True)
class EnginePlanInputs:
    """What an engine's memory-plan lines are computed from (rl/memory_plan.py fills it)."""
    arch: ModelConfig
    rollout: "RolloutConfig"
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
    settings: type[Section]                                          # its own section, rollout.<kind>.*
    check: Callable[[RolloutConfig], Iterable[tuple[str, str]]]      # (field under rollout., message) of each problem
    embedded: bool                                                   # in the trainer's process (it needs the model)
    samples_like_learner: Callable[[RolloutConfig, str], bool]       # (rollout, compute dtype): the float32 learner's numerics
    weights: Callable[[RolloutConfig, str], EngineWeights]           # (rollout, compute dtype)
    plan: Callable[[EnginePlanInputs], tuple[list[PlanLine], int]]   # its memory lines, and the devices it runs on
    describe: Callable[[RolloutConfig], str]                         # its one line in train --plan
    host_refusal: Callable[[RolloutConfig, str], str | None]         # (rollout, device platform): why it cannot run here
    # (rollout, model.lora.rank): why it cannot serve the LoRA adapters a run trains (None: it can)
    adapter_refusal: Callable[[RolloutConfig, int], str | None] = lambda rollout, rank: None
    # (rollout): whether a sync returns before the engines have the weights (background_sync.py)
    lands_in_background: Callable[[RolloutConfig], bool] = lambda rollout: False
    # (rollout, the job's devices) -> (the learner's, the engine's): shared unless it has its own
    devices: Callable[[RolloutConfig, list], tuple[list, list]] = lambda rollout, devices: (list(devices), list(devices))
    # (rollout, model.decode_attention) -> the mesh this process's engine copy is placed on (None: no copy is split)
    mesh: Callable[[RolloutConfig, str], object] = lambda rollout, decode_attention: None
    # (rollout) -> the devices of each process that are the engine's alone (0: it shares the learner's)
    devices_of_its_own: Callable[[RolloutConfig], int] = lambda rollout: 0


ENGINES: Registry[EngineKind] = Registry("engine")


def make_engine(cfg: RolloutConfig, model, tokenizer, *, seed: int) -> Engine:
    """The engine `cfg.engine` names. `model`: the embedded engine's model; for vLLM the served
    architecture, used to export and probe synced weights (None: generation only, no sync)."""
    return ENGINES[cfg.engine].build(cfg, model, tokenizer, seed)


def engine_kind(cfg: RolloutConfig) -> EngineKind:
    return ENGINES[cfg.engine]


# Each kind registers itself (one import a kind); `rollout.*` is then built from what registered.
from rstar2_jax.rollout.engines import jax_kind, vllm_kind  # noqa: E402, F401


class _RolloutBase(PartChoice):
    """`rollout.*`: the engine (rollout.engine), the sampling every engine does, and each engine's
    own settings (rollout.<engine>.*; only the chosen engine's are read)."""


# Where each setting of the flat `rollout.*` of earlier versions lives now.
_MOVED = {**{name: f"jax.{name}" for name in ("slots", "reuse_kv", "page_size", "kv_pages", "kv_memory_gb")},
          "vllm_urls": "vllm.urls", "scheduler": "vllm.scheduler",
          **{f"vllm_{name}": f"vllm.{name}" for name in ("export_dtype", "probe_tolerance", "sync", "sync_dir",
                                                         "fetch_urls", "sync_bucket_mb", "sync_host")}}

RolloutConfig = part_section(
    "RolloutConfig", ENGINES, path="rollout", module=__name__, base=_RolloutBase, moved=_MOVED, refuse_unchosen=False,
    selector=("engine", str, setting("jax", "jax (embedded in the learner process, rollout.jax.*) | vllm (servers, "
                                     "rollout.vllm.*)", choices=ENGINES)),
    common=[
        ("max_len", int, setting(640, "KV per sequence: the longest prompt + every stage's max_response_tokens must "
                                 "fit", min=2)),
        ("temperature", float, setting(1.0, "sampling temperature of training rollouts (0: greedy)", min=0.0)),
        ("tool_timeout_s", float, setting(5.0, "seconds a tool call may run", min=0.001)),
    ])
