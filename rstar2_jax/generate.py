"""Sample a reply from a model directory: the end-to-end smoke test of model + tokenizer + cache.

    python -m rstar2_jax.generate --model runs/tiny_model --prompt "What is 12 + 34?"

`--build_tiny` first writes the tiny random model to --model (what `make demo` runs until the
training job exists; a random model produces random bytes, the point is that every part runs).
"""

from __future__ import annotations

import os
import time

from absl import flags, logging

from rstar2_jax import cli

_MODEL = flags.DEFINE_string("model", None, "HF model directory (config.json, safetensors, tokenizer)", required=True)
_PROMPT = flags.DEFINE_multi_string("prompt", ["What is 12 + 34?"], "user message (repeat for a batch)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sampling temperature; 0 = greedy", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_BUILD_TINY = flags.DEFINE_bool("build_tiny", False, "first write the tiny random model to --model")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax import models
    from rstar2_jax.models import tiny
    from rstar2_jax.models.generate import generate
    from rstar2_jax.models.tokenizer import Tokenizer

    model_dir = _MODEL.value
    if _BUILD_TINY.value and not os.path.exists(os.path.join(model_dir, "config.json")):
        tiny.build_tiny_model(model_dir)
        print(f"built tiny random Qwen3 model in {model_dir}")
    model_dir = cli.model_dir(model_dir)
    model = models.load_pretrained(model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True) for p in _PROMPT.value]
    cfg = model.cfg
    print(f"model: {cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size}")
    generate(model, prompts, max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, seed=_SEED.value)
    start = time.perf_counter()  # second call: compiled, so this times generation alone
    out = generate(model, prompts, max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                   seed=_SEED.value)
    seconds = time.perf_counter() - start
    for prompt, ids, logps in zip(_PROMPT.value, out.token_ids, out.logprobs):
        print(f"\nprompt: {prompt}\nreply ({len(ids)} tokens, mean log-prob {sum(logps) / max(len(ids), 1):.2f}): "
              f"{tokenizer.decode(ids)!r}")
    total = sum(len(ids) for ids in out.token_ids)
    print(f"\n{total} tokens in {seconds:.2f} s ({total / seconds:.0f} tokens/s, batch {len(prompts)}, CPU)")


if __name__ == "__main__":
    cli.run(main)
