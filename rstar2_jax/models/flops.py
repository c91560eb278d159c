"""Model FLOPs and decode bytes: the numerators of MFU and of the HBM roofline.

Pure arithmetic over a ModelConfig. Conventions (those of MaxText / PaLM's MFU):
- a matmul of [m, k] x [k, n] is 2 m k n FLOPs; elementwise work, norms and softmax are not counted;
- the embedding lookup is a gather (0 FLOPs); the LM head is a matmul over the whole vocabulary;
- causal attention counts the scores and values products over the keys a query actually sees
  (on average (T + 1) / 2 of T), which is what a flash kernel that skips masked blocks executes;
  `causal=False` counts all T (what a plain masked XLA implementation executes);
- a training step is 3x the forward (backward = 2x forward); rematerialisation is not model work.
"""

from __future__ import annotations

from rstar2_jax.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: attention and MLP projections, LM head."""
    e, h, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_layer = e * h * d + 2 * e * kv * d + h * d * e + 3 * e * m
    return cfg.num_layers * per_layer + e * cfg.vocab_size


def param_count(cfg: ModelConfig) -> int:
    """All parameters (embedding included; the LM head once when tied; norms and biases)."""
    e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = 2 * e + (2 * d if cfg.qk_norm else 0) + ((h + 2 * kv) * d if cfg.attention_bias else 0)
    embed = cfg.vocab_size * e
    head = 0 if cfg.tie_word_embeddings else e * cfg.vocab_size
    return matmul_params(cfg) - e * cfg.vocab_size + head + embed + cfg.num_layers * per_layer + e


def attention_flops(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Scores + weighted values of one sequence of seq_len tokens, all layers (forward)."""
    keys_seen = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys_seen


def forward_flops(cfg: ModelConfig, seq_len: int, rows: int = 1, *, causal: bool = True) -> float:
    return rows * (2.0 * matmul_params(cfg) * seq_len + attention_flops(cfg, seq_len, causal=causal))


def train_step_flops(cfg: ModelConfig, seq_len: int, rows: int) -> float:
    """Model FLOPs of one optimizer step on rows x seq_len tokens (forward + backward)."""
    return 3.0 * forward_flops(cfg, seq_len, rows)


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """Keys and values of one token, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value


def decode_step_bytes(cfg: ModelConfig, live_lengths, *, param_bytes: int = 2, kv_bytes: int = 2) -> float:
    """The least HBM traffic of one decode step: every weight once (the LM head included, the
    embedding only for the rows it gathers) plus each row's live keys and values (read) and the
    new token's (written). live_lengths: per busy row, the cache slots it attends to."""
    e = cfg.hidden_size
    weights = (param_count(cfg) - cfg.vocab_size * e + (cfg.vocab_size * e if cfg.tie_word_embeddings else 0))
    rows = len(live_lengths)
    gathered = rows * e
    kv = kv_bytes_per_token(cfg, kv_bytes) * (sum(live_lengths) + rows)
    return param_bytes * (weights + gathered) + kv
