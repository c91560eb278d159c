"""The run's model settings (`model.*`) and the model directory they name: a HF checkpoint (a
directory, or a hub id through the Hugging Face cache: models/hub.py), or the tiny random model."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from rstar2_jax.config_types import Section, setting
from rstar2_jax.models import hub
from rstar2_jax.models.decoder import DECODE_ATTENTION, FULL_ATTENTION, REMAT_POLICIES
from rstar2_jax.registry import Registry

DTYPES = Registry("dtype")
DTYPES.register("float32", jnp.float32)
DTYPES.register("bfloat16", jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PolicyModelConfig(Section):
    path: str = setting("", "HF model directory, or a hub id (owner/name[@revision]) read through the Hugging Face "
                        "cache; '' builds the tiny random model in the run directory")
    tiny_layers: int = setting(2, "tiny model (path ''): decoder layers", min=1)
    tiny_hidden: int = setting(128, "tiny model (path ''): hidden size", min=32)
    dtype: str = setting("float32", "compute dtype (parameters stay float32)", choices=DTYPES)
    remat: str = setting("none", "rematerialisation of each layer in the backward pass",
                         choices=tuple(REMAT_POLICIES))
    attention: str = setting("xla", "full forwards: xla | cudnn (NVIDIA; see BENCHMARKS.md)", choices=FULL_ATTENTION)
    decode_attention: str = setting("xla", "engine decode: xla | pallas (ragged; rollout.max_len % 128 == 0 "
                                    "unless paged)", choices=DECODE_ATTENTION)

    def rules(self):
        problem = hub.check(self.path)
        if problem:
            yield "path", problem


def resolve(model_cfg: PolicyModelConfig, workdir: str, seed: int) -> str:
    """`model_cfg.path` when set; otherwise the tiny random model (`tiny_layers`, `tiny_hidden`),
    built once into `workdir/base_model` and reused by every later start of the run."""
    if model_cfg.path:
        return hub.model_directory(model_cfg.path)  # a directory as it is; a hub id through the cache
    model_dir = os.path.join(workdir, "base_model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from rstar2_jax.models import tiny  # loads only for runs that build it
        tiny.build_tiny_model(model_dir, seed=seed, num_layers=model_cfg.tiny_layers,
                              hidden_size=model_cfg.tiny_hidden, intermediate_size=3 * model_cfg.tiny_hidden)
    return model_dir
