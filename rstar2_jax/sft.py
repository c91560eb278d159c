"""Supervised fine-tuning on chat / tool-call JSONL (the paper's non-reasoning SFT stage).

    python -m rstar2_jax.sft --model DIR --data train.jsonl --out runs/sft_model [--steps 1000]

Writes a HF directory (same format as the input; the RL config loads it as model.path).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from rstar2_jax import cli

_MODEL = flags.DEFINE_string("model", None,
                             "HF model directory, or a hub id (owner/name[@revision]) through the Hugging Face cache",
                             required=True)
_DATA = flags.DEFINE_string("data", None, "JSONL of {'messages': [...]} conversations", required=True)
_OUT = flags.DEFINE_string("out", None, "output HF directory", required=True)
_STEPS = flags.DEFINE_integer("steps", 1000, "optimizer steps", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 16, "conversations per step", lower_bound=1)
_LR = flags.DEFINE_float("lr", 1e-5, "peak learning rate", lower_bound=0.0)
_WARMUP = flags.DEFINE_integer("warmup_steps", 50, "linear warm-up steps", lower_bound=0)
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "conversations are cut to this many tokens", lower_bound=2)
_BUDGET = flags.DEFINE_integer("token_budget", 0, "pack each step's conversations into rows of this many tokens "
                               "(at least --max_len; 0: one padded row per conversation)", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "shuffling seed")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)

    from rstar2_jax import models
    from rstar2_jax.data.chat_sft import load_conversations, tokenize_conversation
    from rstar2_jax.learner.sft import SFTTrainer
    from rstar2_jax.models.tokenizer import Tokenizer

    model_dir = cli.model_dir(_MODEL.value)  # a directory, or a hub id through the cache
    if not os.path.isfile(_DATA.value):
        raise app.UsageError(f"--data={_DATA.value}: no such file")
    if _BUDGET.value and _BUDGET.value < _MAX_LEN.value:
        raise app.UsageError(f"--token_budget={_BUDGET.value} is below --max_len={_MAX_LEN.value}: a packed row must "
                             "hold the longest conversation (raise it, or 0 for padded rows)")
    tokenizer = Tokenizer.from_pretrained(model_dir)
    data = [tuple(x[:_MAX_LEN.value] for x in tokenize_conversation(tokenizer, row))
            for row in load_conversations(_DATA.value)]
    model = models.load_pretrained(model_dir)
    trainer = SFTTrainer(model, lr=_LR.value, warmup_steps=_WARMUP.value, token_budget=_BUDGET.value)
    trainer.train(data, _STEPS.value, min(_BATCH.value, len(data)), _SEED.value)
    models.save_pretrained(trainer.model(), _OUT.value, tokenizer_dir=model_dir)
    print(f"saved {_OUT.value}")


if __name__ == "__main__":
    cli.run(main)
