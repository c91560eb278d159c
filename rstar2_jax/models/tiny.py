"""A tiny Qwen3-architecture model with random weights and a character-level tokenizer.

For tests and the CPU demo: a real HF directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that our loader, transformers and vLLM's CPU build all
load. Constraints from vLLM's CPU attention (see shared/notes/vllm.md): head_dim >= 32, and
untied embeddings so `reload_weights` updates the output layer too.

The tokenizer is byte-level BPE trained locally with no merges: every UTF-8 byte is one token
(digits are single tokens, which suits arithmetic), plus Qwen's chat and tool-call tokens.

    python -m rstar2_jax.generate --model runs/tiny_model --build_tiny   # writes it, then samples from it
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
from flax import nnx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from rstar2_jax.models.checkpoint import save_pretrained
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.decoder import Decoder

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
# Added (not special): they appear in decoded text, and the tool loop matches them by id.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Hermes-style tools block and ChatML turns, as Qwen2.5/Qwen3 render them.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
    + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def tiny_config(**overrides: Any) -> ModelConfig:
    fields = dict(family="qwen3", vocab_size=320, hidden_size=128, intermediate_size=384, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, qk_norm=True, max_position_embeddings=4096)
    fields.update(overrides)
    return ModelConfig(**fields)


def build_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: 256 byte tokens, then the special and tool tokens (ids 256...)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet), initial_alphabet=alphabet,
                                  special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator(["0123456789 +-*/=()"], trainer=trainer)  # bytes only: no merges
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    added = {str(i): {"content": tok.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": tok.special}
             for i, tok in sorted(tokenizer.get_added_tokens_decoder().items())}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0, dtype=jnp.float32,
                     **config_overrides: Any) -> str:
    """Write a tiny random Qwen3 HF directory to `out_dir` and return its path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    cfg = tiny_config(eos_token_id=eos_id, pad_token_id=pad_id, **config_overrides)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} < tokenizer size {tokenizer.get_vocab_size()}")
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))
    save_pretrained(model, out_dir)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(tokenizer, cfg.max_position_embeddings), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_id, "pad_token_id": pad_id}, f, indent=2)
    return out_dir

