"""The learner's weights as this process's engine holds them after an update.

The engine's kind says how (rollout/engines/factory.EngineWeights): the learner's own arrays where
that is safe (a served engine's sync streams them; float32 on one device, on-policy), else a copy
in the engine's dtype, split over the engine's devices (`engine_mesh`). The learner's update
donates its buffers, so anything the engine keeps across an update is a copy. On devices of the
engine's own (rollout.jax.devices) that copy is the device-to-device reshard of the weights.
"""

from __future__ import annotations

from typing import Any

from rstar2_jax.core import processes
from rstar2_jax.core import sharding
from rstar2_jax.learner import Learner
from rstar2_jax.models import lora
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rollout.engines import engine_kind


def engine_weights(learner: Learner, cfg: RunConfig, learner_devices: int) -> Any:
    """What to give the engine's sync_weights for `learner`'s current parameters."""
    params = learner.model_state()
    kind = engine_kind(cfg.rollout)
    how = kind.weights(cfg.rollout, cfg.model.dtype)
    if how.shares(learner_devices=learner_devices, on_policy=cfg.rl.max_staleness == 0):
        return params
    dtype = DTYPES[how.dtype] if how.dtype else None
    mesh = kind.mesh(cfg.rollout, cfg.model.decode_attention) if how.split else None
    frozen = learner.frozen  # LoRA: the base, never donated, read as it is (one copy); adapters copied
    if frozen is not None and mesh is None and learner_devices == 1 and how.dtype in (None, cfg.model.dtype):
        return lora.whole(processes.local_copy(learner.state.params, dtype), frozen)
    return processes.local_copy(params, dtype, sharding.param_shardings(params, mesh) if mesh else None)
