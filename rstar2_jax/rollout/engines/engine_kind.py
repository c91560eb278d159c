"""What an engine kind is (`EngineKind`) and the registry of them (`ENGINES`): everything the rest
of the code asks about an engine without naming it. Each kind is its own module (jax_engine/kind.py,
vllm_engine/kind.py) that registers one EngineKind here; factory.py imports them and builds the
`rollout.*` settings from what registered. Below both: a kind never imports the factory.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from rstar2_jax.core.config_types import Section
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.core.registry import Registry
from rstar2_jax.rollout.engines.base import Engine

RolloutSection = Section  # the `rollout.*` section (factory.RolloutSection), as the kinds see it


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
    rollout: RolloutSection
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
    remedy: str = ""  # what to change when it does not fit (the engine's lines name their own settings)


@dataclasses.dataclass(frozen=True)
class EngineKind:
    build: Callable[..., Engine]                                     # (rollout_cfg, model, tokenizer, seed) -> Engine
    settings: type[Section]                                          # its own section, rollout.<kind>.*
    check: Callable[[RolloutSection], Iterable[tuple[str, str]]]      # (field under rollout., message) of each problem
    embedded: bool                                                   # in the trainer's process (it needs the model)
    samples_like_learner: Callable[[RolloutSection, str], bool]       # (rollout, compute dtype): the float32 learner's numerics
    weights: Callable[[RolloutSection, str], EngineWeights]           # (rollout, compute dtype)
    plan: Callable[[EnginePlanInputs], tuple[list[PlanLine], int]]   # its memory lines, and the devices it runs on
    describe: Callable[[RolloutSection], str]                         # its one line in train --plan
    host_refusal: Callable[[RolloutSection, str], str | None]         # (rollout, device platform): why it cannot run here
    # (rollout, model.decode_attention): why it cannot decode with that attention (None: it can)
    attention_refusal: Callable[[RolloutSection, str], str | None] = lambda rollout, decode_attention: None
    # (rollout, model.lora.rank): why it cannot serve the LoRA adapters a run trains (None: it can)
    adapter_refusal: Callable[[RolloutSection, int], str | None] = lambda rollout, rank: None
    # (rollout): whether a sync returns before the engines have the weights (vllm_engine/sync/background.py)
    lands_in_background: Callable[[RolloutSection], bool] = lambda rollout: False
    # (rollout, the job's devices) -> (the learner's, the engine's): shared unless it has its own
    devices: Callable[[RolloutSection, list], tuple[list, list]] = lambda rollout, devices: (list(devices), list(devices))
    # (rollout, model.decode_attention) -> the mesh this process's engine copy is placed on (None: no copy is split)
    mesh: Callable[[RolloutSection, str], object] = lambda rollout, decode_attention: None
    # evaluate's flags for its settings: (flag, field of its section); typed and described by the field
    cli_flags: tuple[tuple[str, str], ...] = ()
    # its settings (under rollout.<kind>.) a resumed run may change: where the engine runs, not what it samples
    resumable: tuple[str, ...] = ()
    # (its own settings section, rollout.<kind>) -> the multiple a sequence's KV length is rounded up to
    context_granule: Callable[[Section], int] = lambda own: 1
    # (rollout) -> the devices of each process that are the engine's alone (0: it shares the learner's)
    devices_of_its_own: Callable[[RolloutSection], int] = lambda rollout: 0


ENGINES: Registry[EngineKind] = Registry("engine")
