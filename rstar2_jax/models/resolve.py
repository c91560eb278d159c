"""The run's model settings (`model.*`) and the model directory they name: a HF checkpoint (a
directory, or a hub id through the Hugging Face cache: models/hub.py), or the tiny random model."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.models import hub
from rstar2_jax.models.attention import DECODE_ATTENTION, FULL_ATTENTION
from rstar2_jax.models.decoder import REMAT_POLICIES
from rstar2_jax.models.lora import LoRAConfig
from rstar2_jax.core.registry import Registry

DTYPES = Registry("dtype")
DTYPES.register("float32", jnp.float32)
DTYPES.register("bfloat16", jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PolicyModelConfig(Section):
    path: str = setting("", "HF model directory, or a hub id (owner/name[@revision]) read through the Hugging Face "
                        "cache; '' builds the tiny random model in the run directory")
    tiny_layers: int = setting(2, "tiny model (path ''): decoder layers", min=1)
    tiny_hidden: int = setting(128, "tiny model (path ''): hidden size", min=32)
    dtype: str = setting("float32", "compute dtype (trained parameters stay float32; with LoRA the frozen base is "
                         "held in it)", choices=DTYPES)
    remat: str = setting("none", "rematerialisation of each layer in the backward pass: none | dots (matmul "
                         "outputs kept) | dots_attention (and cuDNN attention's outputs) | full (layer inputs only)",
                         choices=tuple(REMAT_POLICIES))
    attention: str = setting("xla", "full forwards: xla | cudnn (NVIDIA; see BENCHMARKS.md)", choices=FULL_ATTENTION)
    decode_attention: str = setting("xla", "engine decode: xla | pallas (ragged; rollout.max_len % 128 == 0 "
                                    "unless paged)", choices=DECODE_ATTENTION)
    lora: LoRAConfig = setting(LoRAConfig, "low-rank adapters: train them, not the model (rank 0: off)")

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


def load_policy(model_cfg: PolicyModelConfig, model_dir: str, *, seed: int, mesh=None):
    """The run's policy from `model_dir`: the decoder with its settings (compute dtype, remat,
    attention), its trained parameters float32 (master weights), and with model.lora.rank > 0
    the base frozen in the compute dtype with fresh adapters on the targets (models/lora.py).
    A rank the model cannot take is a ConfigValueError before the weights are read."""
    from rstar2_jax.core.config_types import ConfigProblem, ConfigValueError
    from rstar2_jax.models import lora
    from rstar2_jax.models.checkpoint import load_pretrained
    from rstar2_jax.models.config import ModelConfig

    adapters = model_cfg.lora
    if adapters.enabled:
        problems = lora.rank_problems(adapters, ModelConfig.from_json_file(os.path.join(model_dir, "config.json")))
        if problems:
            raise ConfigValueError([ConfigProblem("model.lora.rank", p) for p in problems])
    dtype = DTYPES[model_cfg.dtype]
    model = load_pretrained(model_dir, dtype=dtype, param_dtype=dtype if adapters.enabled else jnp.float32, mesh=mesh)
    model.remat = model_cfg.remat
    model.set_attention(full=model_cfg.attention, decode=model_cfg.decode_attention)
    return lora.attach(model, adapters, seed=seed)
