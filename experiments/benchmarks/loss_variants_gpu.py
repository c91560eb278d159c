"""Every registered loss and aggregation through the real update on the device at hand, float32
and bfloat16 compute: finite metrics, and the bf16 update's gap to the float32 one.

    python -m experiments.benchmarks.loss_variants_gpu [--hidden 1024 --layers 4 --rows 32 --length 512]

Prints one row per (loss, aggregation, dtype): policy loss, grad norm, ppo_kl, clip fractions
after a second update (the first is on-policy: ratio 1), the relative parameter-update gap of
bf16 to float32, and milliseconds per update (median of 5, after a compile). A JAX-version check
as much as a numerics one: the GPU machine runs a newer JAX than the CPU one.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.algo import LOSSES, PolicyLossConfig
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.models import Decoder, ModelConfig


def batch(rows, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = [list(rng.integers(1, vocab, size=int(rng.integers(length // 2, length)))) for _ in range(rows)]
    masks = [[0] * 16 + [1] * (len(t) - 16) for t in tokens]
    return make_batch(tokens, masks, [[0.0] * len(t) for t in tokens], list(rng.normal(size=rows)), pad_multiple=128)


def flat(learner):
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(learner.state.params)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=512)
    args = p.parse_args()
    cfg = ModelConfig(family="qwen3", vocab_size=32768, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_layers=args.layers, num_heads=args.hidden // 128, num_kv_heads=max(args.hidden // 512, 1),
                      head_dim=128, qk_norm=True)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    cases = [(name, agg) for name in LOSSES for agg in
             ((LOSSES[name].aggregations or ("token_mean", "seq_mean_token_mean", "constant")))]
    rows = []
    for name, agg in cases:
        start = {}
        for dtype in (jnp.float32, jnp.bfloat16):
            import flax.nnx as nnx
            model = Decoder(cfg, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
            loss = PolicyLossConfig(name=name, aggregation=agg)
            learner = Learner(model, LearnerSettings(lr=1e-4, warmup_steps=1, loss=loss, mini_batches=2, epochs=1),
                              constant_tokens=float(args.length), own_params=True)
            before = flat(learner)
            b = batch(args.rows, args.length, cfg.vocab_size)
            m = learner.update(b)                      # compiles; mini-batch 2 sees a moved policy
            times = []
            for _ in range(5):
                b = batch(args.rows, args.length, cfg.vocab_size)
                t = time.perf_counter()
                m = learner.update(b)
                jax.block_until_ready(learner.state.params)
                times.append(time.perf_counter() - t)
            start[dtype] = flat(learner) - before
            finite = all(np.isfinite(v) for v in m.values())
            gap = (np.linalg.norm(start[jnp.bfloat16] - start[jnp.float32]) / np.linalg.norm(start[jnp.float32])
                   if dtype == jnp.bfloat16 else 0.0)
            rows.append((name, agg, jnp.dtype(dtype).name, m["policy_loss"], m["grad_norm"], m["ppo_kl"],
                         m.get("clip_low_fraction", 0.0), m.get("clip_high_fraction", 0.0), gap,
                         1e3 * float(np.median(times)), finite))
    print(f"{'loss':12} {'aggregation':20} {'dtype':9} {'loss':>10} {'grad':>9} {'ppo_kl':>10} {'clip_lo':>8} "
          f"{'clip_hi':>8} {'bf16 gap':>9} {'ms':>8} finite")
    for r in rows:
        print(f"{r[0]:12} {r[1]:20} {r[2]:9} {r[3]:10.4g} {r[4]:9.3g} {r[5]:10.3g} {r[6]:8.4f} {r[7]:8.4f} "
              f"{r[8]:9.3g} {r[9]:8.1f} {r[10]}")
    assert all(r[-1] for r in rows), "a non-finite metric"


if __name__ == "__main__":
    main()
