"""Shapes of public checkpoints (their config.json values), for what needs an architecture but no
weights: the memory plan's figures, benchmarks on random weights, SCALING.md's tables."""

from __future__ import annotations

from rstar2_jax.models.config import ModelConfig, RopeConfig

_QWEN3 = dict(family="qwen3", vocab_size=151936, num_kv_heads=8, head_dim=128, qk_norm=True,
              rope=RopeConfig(theta=1e6), max_position_embeddings=40960)

SHAPES: dict[str, dict] = {
    "qwen3_0p6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3_1p7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3_4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                     tie_word_embeddings=True),
    "qwen3_14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
                      tie_word_embeddings=False),
    # for trying scripts on a CPU
    "tiny": dict(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=True),
}


def shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[name])


# The hub ids of the public checkpoints whose shapes are above (a plan needs no download).
PUBLIC_IDS = {"Qwen/Qwen3-0.6B": "qwen3_0p6b", "Qwen/Qwen3-1.7B": "qwen3_1p7b", "Qwen/Qwen3-4B": "qwen3_4b",
              "Qwen/Qwen3-14B": "qwen3_14b"}


def plan_architecture(spec: str) -> ModelConfig:
    """The architecture `train --plan_model` plans for: a shape's name (SHAPES), a public hub id
    (PUBLIC_IDS), a config.json, or a directory holding one (the weights are never read)."""
    import os
    if spec in SHAPES:
        return shape(spec)
    if spec in PUBLIC_IDS:
        return shape(PUBLIC_IDS[spec])
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        return ModelConfig.from_json_file(path)
    raise ValueError(f"--plan_model={spec}: not a shape ({', '.join(sorted(SHAPES))}), a public id "
                     f"({', '.join(sorted(PUBLIC_IDS))}), a config.json or a directory holding one")
