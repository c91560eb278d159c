"""Policy models: one Flax NNX decoder for Qwen3, Qwen2/2.5 and Llama 3, with HF checkpoint I/O."""

from rstar2_jax.models.checkpoint import (CheckpointError, abstract_model, load_pretrained,
                                          save_pretrained)
from rstar2_jax.models.config import ConfigError, ModelConfig, RopeConfig
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.kv_cache import KVCache, PagedKVCache, init_cache, init_paged_cache
from rstar2_jax.models.logprobs import token_logprobs, token_logprobs_from_hidden
from rstar2_jax.models.resolve import resolve

__all__ = [
    "CheckpointError", "ConfigError", "Decoder", "KVCache", "ModelConfig", "PagedKVCache", "RopeConfig",
    "abstract_model", "init_cache", "init_paged_cache", "load_pretrained", "resolve", "save_pretrained", "token_logprobs",
    "token_logprobs_from_hidden",
]
