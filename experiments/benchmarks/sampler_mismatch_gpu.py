"""The sampler-vs-learner log-prob gap: the embedded engine in bf16 against the float32 learner,
on-policy (k = 0) and one version stale (k = 1), and what each correction does to it.

    python -m experiments.benchmarks.sampler_mismatch_gpu [--model qwen3_0p6b] [--new 256] [--batches 1,8,64]

Random weights of a public shape (no checkpoint downloads here): the engine samples `new` tokens
at T = 1 for `batch` prompts of 64 random tokens, with bf16 weights and compute (what
`model.dtype=bfloat16` gives the embedded engine); the learner recomputes the same tokens' log-
probs with the float32 master weights and float32 compute. k = 1: the learner has taken one more
update (the paper's lr 1e-6, Adam, one step on these rollouts with random advantages) than the
weights that sampled. mean |delta| is over sampled tokens, in nats. Then, on the k = 1 batch of
the largest size, every correction at its default constants: the share of tokens it drops or
clips and the effective sample size of its weights (algo/corrections).
"""

from __future__ import annotations

import argparse
import asyncio

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from experiments.benchmarks.engine_decode import _NoTokenizer
from rstar2_jax.algo.corrections import CORRECTIONS, CorrectionConfig, CorrectionInputs, correction_metrics
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.models import Decoder
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.sampling import SamplingParams

PROMPT = 64


def engine_model(cfg, params):
    """The engine's copy: bf16 compute and bf16 weights (trainer.engine_weights casts the same way)."""
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model, nnx.Param)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def sample(model, batch: int, new: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.cfg.vocab_size, PROMPT).tolist() for _ in range(batch)]

    async def go():
        async with JaxEngine(model, _NoTokenizer(), slots=batch, max_len=-(-(PROMPT + new) // 128) * 128,
                             eos_ids=(), seed=seed) as engine:
            return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=new, temperature=1.0,
                                                                            seed=i)) for i, p in enumerate(prompts)))
    outs = asyncio.run(go())
    return make_batch([p + o.token_ids for p, o in zip(prompts, outs)],
                      [[0] * PROMPT + [1] * len(o.token_ids) for o in outs],
                      [[0.0] * PROMPT + list(o.logprobs) for o in outs],
                      list(np.random.default_rng(seed + 1).standard_normal(batch)), pad_multiple=128)


def gap(batch, learner_lp) -> float:
    m = batch.loss_mask > 0
    return float(np.abs(learner_lp - batch.sampler_logprobs)[m].mean())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", default="1,8,64")
    args = p.parse_args(argv)
    common.enable_compile_cache()
    cfg = common.shape(args.model)
    print(f"{args.model}; {common.device_line()}", flush=True)
    fp32 = Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    learner = Learner(fp32, LearnerSettings(lr=1e-6, warmup_steps=0, token_entropy=False))
    rows, last = [], None
    for batch_size in map(int, args.batches.split(",")):
        sampled_with = learner.model_state()
        batch = sample(engine_model(cfg, sampled_with), batch_size, args.new, seed=batch_size)
        k0 = gap(batch, learner.logprobs(batch.tokens))
        stale = Learner(nnx.merge(learner.graphdef, jax.tree.map(jnp.copy, sampled_with)),
                        LearnerSettings(lr=1e-6, warmup_steps=0, token_entropy=False,  # 8-row micro-batches: memory
                                        micro_batches=min(batch_size, 8)))
        stale.update(batch)  # one version newer than the weights that sampled
        batch.old_logprobs = None
        k1_lp = stale.logprobs(batch.tokens)
        k1 = gap(batch, k1_lp)
        rows.append([batch_size, int((batch.loss_mask > 0).sum()), f"{k0:.4f}", f"{k1:.4f}"])
        print(rows[-1], flush=True)
        last = (batch, k1_lp)
        del stale
    print(common.markdown_table(["batch", "sampled tokens", "k=0 mean |delta| (nats)", "k=1 mean |delta| (nats)"],
                                rows))
    batch, learner_lp = last
    inputs = CorrectionInputs(learner_lp, batch.sampler_logprobs, batch.loss_mask > 0)
    table = []
    base = correction_metrics((), CorrectionConfig().settings_of, inputs)
    for name in CORRECTIONS:
        cfg_c = CorrectionConfig(names=(name,))
        m = correction_metrics(cfg_c.names, cfg_c.settings_of, inputs)
        table.append([name, f"{m['correction/masked_fraction']:.4f}", f"{m[f'correction/{name}/clipped_fraction']:.4f}",
                      f"{m['correction/ess']:.4f}", f"{m['correction/weight_mean']:.4f}"])
    print(f"k=1, batch {batch.tokens.shape[0]}: mismatch k1/token {base['mismatch/k1_token']:.5f}, "
          f"k3/token {base['mismatch/k3_token']:.5f}, k1/seq {base['mismatch/k1_seq']:.3f}, "
          f"k3/seq {base['mismatch/k3_seq']:.3f}")
    print(common.markdown_table(["correction", "dropped", "clipped", "ESS", "weight mean"], table))


if __name__ == "__main__":
    main()
