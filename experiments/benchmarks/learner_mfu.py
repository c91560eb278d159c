"""Learner throughput and MFU: one GRPO-RoC optimizer step on a Qwen3-shaped model.

    python -m experiments.benchmarks.learner_mfu --model qwen3_1p7b --seq 4096 \
        --variants cudnn:full:1,cudnn:full:4,cudnn:dots:4 [--record BENCHMARKS.md] [--profile DIR]

A variant is attention:remat:rows (attention xla|cudnn; remat none|dots|full). Random weights,
fp32 master parameters, bf16 compute, the real policy loss (clip-higher, as the paper) and AdamW
via `Learner.update`, on rows of --seq tokens (a quarter prompt, three quarters loss-masked
response). MFU = model FLOPs of the step (rstar2_jax.models.flops: 6 x matmul params x tokens +
causal attention) over the H100's dense bf16 peak, and over the bf16 matmul rate measured in the
same run. The old-log-prob forward a separate pass runs before each update is timed separately,
and the one-pass update (rl.old_logprobs=auto: the old log-probs from the update's own forward,
issue 81) is timed whole, against the step plus that pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from rstar2_jax.learner import Learner, LearnerSettings
from rstar2_jax.learner.batching import TrainBatch
from rstar2_jax.models import Decoder, flops


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 4:] = 1.0
    return TrainBatch(tokens=rng.integers(0, vocab, (rows, seq), dtype=np.int32), loss_mask=mask,
                      advantages=rng.choice([-1.0, 1.0], rows).astype(np.float32),
                      sampler_logprobs=-rng.exponential(1.0, (rows, seq)).astype(np.float32))


def run_variant(cfg, attention: str, remat: str, rows: int, seq: int, steps: int, profile_dir: str | None):
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), remat=remat)
    model.set_attention(full=attention)
    learner = Learner(model, LearnerSettings(lr=1e-6, warmup_steps=1))
    del model
    batch = make_batch(rows, seq, cfg.vocab_size)
    start = time.perf_counter()
    old = learner.logprobs(batch.tokens)
    compile_lp = time.perf_counter() - start
    batch.old_logprobs = old
    start = time.perf_counter()
    learner.update(batch)
    compile_step = time.perf_counter() - start
    t_lp = common.median_seconds(lambda: learner.logprobs(batch.tokens), repeats=steps, warmup=1)
    t_step = common.median_seconds(lambda: learner.update(batch), repeats=steps, warmup=1)
    # one pass: the batch brings no old log-probs (the update fills them from its own forward)
    t_one = common.median_seconds(lambda: learner.update(dataclasses.replace(batch, old_logprobs=None, entropy=None)),
                                  repeats=steps, warmup=1)
    if profile_dir:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(2):
                learner.update(batch)
    peak_gib = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2 ** 30
    learner = None  # (not del: the timing lambdas above close over the name)
    gc.collect()
    return dict(t_lp=t_lp, t_step=t_step, t_one=t_one, compile_s=compile_lp + compile_step, peak_gib=peak_gib)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_1p7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--variants", default="xla:full:1,cudnn:full:4,cudnn:none:4,cudnn:dots:8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--matmul_n", type=int, default=8192)
    p.add_argument("--record", help="append the result block to this markdown file")
    p.add_argument("--profile", help="trace two steps of the last variant into this directory")
    args = p.parse_args(argv)
    common.enable_compile_cache()
    cfg = common.shape(args.model)
    print(f"{args.model}: {flops.param_count(cfg) / 1e9:.2f}B params; {common.device_line()}", flush=True)
    mm_rate = common.matmul_rate(args.matmul_n)
    print(f"measured bf16 matmul rate ({args.matmul_n}^3): {mm_rate / 1e12:.0f} TFLOP/s", flush=True)

    rows_out = []
    variants = [v.split(":") for v in args.variants.split(",")]
    for i, (attention, remat, rows) in enumerate(variants):
        rows = int(rows)
        label = f"{attention}/{remat}/{rows}x{args.seq}"
        try:
            r = run_variant(cfg, attention, remat, rows, args.seq, args.steps,
                            args.profile if i == len(variants) - 1 else None)
        except Exception as e:  # an OOM or unsupported kernel is a result too
            msg = str(e).splitlines()[0][:120]
            print(f"{label}: FAILED {type(e).__name__}: {msg}", flush=True)
            rows_out.append([attention, remat, rows, "failed", msg, "", "", "", "", "", "", ""])
            gc.collect()
            continue
        tokens = rows * args.seq
        step_flops = flops.train_step_flops(cfg, args.seq, rows)
        lp_flops = flops.forward_flops(cfg, args.seq, rows)
        mfu = step_flops / r["t_step"] / common.H100_DENSE_BF16
        mfu_measured = step_flops / r["t_step"] / mm_rate
        both = (step_flops + lp_flops) / (r["t_step"] + r["t_lp"]) / common.H100_DENSE_BF16
        rows_out.append([attention, remat, rows, f"{r['t_step'] * 1e3:.0f}", f"{tokens / r['t_step']:.0f}",
                         f"{mfu:.1%}", f"{mfu_measured:.1%}", f"{tokens / r['t_lp']:.0f}", f"{both:.1%}",
                         f"{r['t_one'] * 1e3:.0f}", f"{r['t_one'] / (r['t_step'] + r['t_lp']):.2f}x",
                         f"{r['peak_gib']:.1f}"])
        print(f"{label}: step {r['t_step'] * 1e3:.0f} ms, {tokens / r['t_step']:.0f} tok/s, MFU {mfu:.1%} "
              f"(of measured matmul {mfu_measured:.1%}); log-prob pass {tokens / r['t_lp']:.0f} tok/s; "
              f"compile {r['compile_s']:.0f} s; peak {r['peak_gib']:.1f} GiB", flush=True)

    table = common.markdown_table(
        ["attention", "remat", "rows", "step ms", "train tok/s", "MFU (989 TF)", "MFU (measured matmul)",
         "log-prob pass tok/s", "MFU incl. log-prob pass", "one-pass update ms", "one pass / (step + pass)",
         "peak GiB"], rows_out)
    common.record(args.record, f"Learner MFU: {args.model}, seq {args.seq}",
                  "python -m experiments.benchmarks.learner_mfu " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.model} random weights ({flops.param_count(cfg) / 1e9:.2f}B), fp32 params + AdamW, bf16 "
                  f"compute, clip-higher GRPO loss, one micro-batch, median of {args.steps} steps; measured bf16 "
                  f"matmul {mm_rate / 1e12:.0f} TFLOP/s", table, group=common.LEARNER)
    if args.profile:
        from experiments.benchmarks.profile_summary import summarize
        print(summarize(args.profile))


if __name__ == "__main__":
    main()
