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
