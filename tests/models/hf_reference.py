"""Reference models from `transformers` (torch, CPU) with every weight randomised.

HF initialises norms to 1 and biases to 0, which would let a mistake in how we load them go
unseen; here every tensor gets random values so each one matters.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

FAMILIES = {
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "llama3_rope_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, max_position_embeddings=2048,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        rope_theta=10000.0)),
}

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)


def build_hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**SMALL, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_logits(model, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    mask = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask))
    return out.logits.float().numpy()


def right_padded_batch(vocab: int, lengths, seed: int = 0, pad_id: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = rng.integers(1, vocab, size=(len(lengths), t))
    for i, n in enumerate(lengths):
        tokens[i, n:] = pad_id
    return tokens.astype(np.int32)
