"""The model directory a run's config names: a HF checkpoint, or the tiny random model."""

from __future__ import annotations

import os

from rstar2_jax.models import tiny


def resolve(model_cfg, workdir: str, seed: int) -> str:
    """`model_cfg.path` when set; otherwise the tiny random model (`tiny_layers`, `tiny_hidden`),
    built once into `workdir/base_model` and reused by every later start of the run."""
    if model_cfg.path:
        if not os.path.exists(os.path.join(model_cfg.path, "config.json")):
            raise FileNotFoundError(f"model.path {model_cfg.path!r} is not a HF model directory (no config.json)")
        return model_cfg.path
    model_dir = os.path.join(workdir, "base_model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tiny.build_tiny_model(model_dir, seed=seed, num_layers=model_cfg.tiny_layers,
                              hidden_size=model_cfg.tiny_hidden, intermediate_size=3 * model_cfg.tiny_hidden)
    return model_dir
