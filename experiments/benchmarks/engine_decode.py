"""JaxEngine decode throughput against the HBM roofline.

    python -m experiments.benchmarks.engine_decode --model qwen3_0p6b --slots 128,256 --prompt 256 \
        --new 1024 --variants xla:full,pallas:full,pallas:paged64 [--profile DIR] [--record BENCHMARKS.md]

A variant is decode-attention:kv[:splits] ("full": every step reads the whole cache (the
live-prefix buckets measured before issue 82 were removed from the engine); "pagedN": paged KV in pages of N positions, as
much memory as the rows (pallas: the paged kernel reads the pages through the table; xla: gathers
them into rows first); splits: the Pallas kernel's parallel chunks per row and head, default its
own). Random bf16 weights; `slots` requests of `prompt`
tokens each sample exactly `new` tokens (EOS off, temperature 1.0, no top-k/top-p), all slots
busy. Roofline: the least bytes a step must move (every weight once + each row's live keys and
values, rstar2_jax.models.flops.decode_step_bytes) over the copy bandwidth measured in the same
run; the fraction is that floor over the measured decode time. Prefill is timed apart.

--profile DIR: after the table, a jax.profiler trace of one more short run of the last variant
(its programs already compiled), summarized as the device's busy time against the wall time of
the decode (what the host and the launches leave idle) and the top device ops; and the sampling
pass (fp32 log-softmax and Gumbel draw over the whole vocabulary) timed alone at the same batch.
XLA flags (command buffers) are set by the caller's XLA_FLAGS: one process per setting.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common, profile_summary
from rstar2_jax.models import Decoder, flops
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.sampling import SamplingParams, sample


class _NoTokenizer:
    """EOS is off and there are no stop strings, so the engine never decodes text."""

    def decode(self, ids):
        return ""

    def encode(self, text):
        return [0]


async def _generate(engine, prompts, new):
    sampling = SamplingParams(max_tokens=new, temperature=1.0)
    async with engine:
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


def run_variant(model, attention, bucket, splits, slots, prompt, new, decode_steps=1, exit_check=1):
    model.set_attention(decode=attention)
    for layer in model.layers:  # None (the kernel's default) must be settable back
        layer.attn.decode_splits = splits
    max_len = -(-(prompt + new) // 128) * 128
    paged = bucket.startswith("paged")
    if not paged and bucket != "full":  # the engine's kv_bucket was removed (issue 82): BENCHMARKS.md has its figures
        raise ValueError(f"kv bucket {bucket!r}: only 'full' and 'pagedN' (the live-prefix bucket was removed)")
    engine = JaxEngine(model, _NoTokenizer(), slots=slots, max_len=max_len, eos_ids=(),
                       page_size=int(bucket[len("paged"):]) if paged else None, decode_steps=decode_steps,
                       exit_check_steps=exit_check)
    engine.precompile([prompt])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size, prompt).tolist() for _ in range(slots)]
    outs = asyncio.run(_generate(engine, prompts, new))
    assert all(len(o.token_ids) == new for o in outs)
    stats = engine.stats
    # all rows advance in lockstep: at decode step i every row attends to prompt + i + 1 slots
    bytes_total = sum(flops.decode_step_bytes(model.cfg, [prompt + i + 1] * slots) for i in range(new - 1))
    del engine
    gc.collect()
    return stats, bytes_total


def sampling_pass_ms(vocab: int, slots: int, repeats: int = 20) -> float:
    """The decode step's sampling alone: fp32 log-softmax and a per-row Gumbel draw over [slots, vocab]."""
    logits = jax.random.normal(jax.random.key(0), (slots, vocab), jnp.bfloat16)
    keys = jax.vmap(lambda c: jax.random.fold_in(jax.random.key(1), c))(jnp.arange(slots))
    ones, zeros = jnp.ones(slots, jnp.float32), jnp.zeros(slots, jnp.int32)
    fn = jax.jit(lambda x: sample(x, keys, ones, zeros, ones))
    return common.median_seconds(lambda: jax.block_until_ready(fn(logits)), repeats=repeats) * 1e3


# Kernels only a decode runs (the Pallas decode attention): where a GPU trace's decode begins
DECODE_KERNELS = ("mha_forward", "paged_attention")


def profile(model, attention, bucket, splits, slots, prompt, new, decode_steps, exit_check, trace_dir) -> str:
    """One more run of an already compiled variant under jax.profiler: the device's busy time
    from its first decode op on, against that span (what the host and the launches leave idle)."""
    jax.profiler.start_trace(trace_dir)
    stats, _ = run_variant(model, attention, bucket, splits, slots, prompt, new, decode_steps, exit_check)
    jax.profiler.stop_trace()
    # the decode's own line: from the first kernel no prefill runs, the Pallas decode attention's (a
    # GPU trace names kernels, not programs; "decode" alone would match a source file's name)
    busy, span, first = profile_summary.busy_ms(trace_dir, from_op=DECODE_KERNELS)
    where = (f"from the decode's first kernel on ({first[:40]})" if first else
             "over the whole trace, prefill included (no kernel of the decode's own: not Pallas, or not a GPU)")
    return (f"profiled run ({slots} slots, {new} new tokens, {decode_steps} steps per dispatch): prefill "
            f"{stats.prefill_s * 1e3:.0f} ms, decode {stats.decode_s * 1e3:.0f} ms over {stats.decode_steps} steps; "
            f"{where}, the device was busy {busy:.0f} of {span:.0f} ms ({busy / max(span, 1e-9):.0%})\n"
            + profile_summary.by_category(trace_dir, stats.decode_steps, DECODE_KERNELS) + "\n"
            + profile_summary.summarize(trace_dir, 20))


def exit_checks(spec: str, decode_steps: int) -> list[int]:
    """The --exit_check values that apply at `decode_steps` ("all" is the chunk's length; a value
    that does not divide it is left out: the engine refuses it)."""
    values = [decode_steps if v == "all" else int(v) for v in spec.split(",")]
    return sorted({v for v in values if decode_steps % v == 0} or {1})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--slots", default="128", help="concurrent requests, one table row each (128,256)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--variants", default="xla:full,pallas:full")
    p.add_argument("--decode_steps", default="1,16", help="decode steps per dispatch to run each variant at "
                   "(1: one host round trip per token; issue 70's chunks)")
    p.add_argument("--exit_check", default="1", help="decode steps between a chunk's checks for a live slot, each "
                   "run at every --decode_steps it divides ('all': the whole chunk, a loop of a count XLA knows)")
    p.add_argument("--profile", help="trace one more short run of the last variant into this directory")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    common.enable_compile_cache()
    cfg = common.shape(args.model)
    bw = common.copy_bandwidth()
    xla_flags = os.environ.get("XLA_FLAGS", "") or "(none)"
    print(f"{args.model}: {flops.param_count(cfg) / 1e9:.2f}B params; {common.device_line()}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; XLA_FLAGS {xla_flags}", flush=True)
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rows = []
    runs = [(int(n), v, int(k), e) for n in args.slots.split(",") for v in args.variants.split(",")
            for k in args.decode_steps.split(",") for e in exit_checks(args.exit_check, int(k))]
    for slots, variant, k, e in runs:
        attention, bucket, *splits = variant.split(":")
        splits = int(splits[0]) if splits else None
        try:
            stats, bytes_total = run_variant(model, attention, bucket, splits, slots, args.prompt, args.new, k, e)
        except Exception as err:
            msg = str(err).splitlines()[0][:120]
            print(f"{slots} x {variant} x{k}/{e}: FAILED {type(err).__name__}: {msg}", flush=True)
            rows.append([slots, attention, bucket, splits or "default", k, e, "failed", msg, "", "", "", ""])
            continue
        decode_tokens = slots * (args.new - 1)
        floor_s = bytes_total / bw
        step_ms = stats.decode_s / stats.decode_steps * 1e3
        rows.append([slots, attention, bucket, splits or "default", k, e, f"{decode_tokens / stats.decode_s:.0f}",
                     f"{step_ms:.2f}", f"{floor_s / stats.decode_steps * 1e3:.2f}", f"{floor_s / stats.decode_s:.1%}",
                     f"{slots * args.prompt / stats.prefill_s:.0f}", f"{stats.slot_utilization:.0%}"])
        print(f"{slots} x {variant} x{k}/{e}: decode {decode_tokens / stats.decode_s:.0f} tok/s, step {step_ms:.2f} ms "
              f"(floor {floor_s / stats.decode_steps * 1e3:.2f} ms) = {floor_s / stats.decode_s:.1%} of roofline; "
              f"prefill {slots * args.prompt / stats.prefill_s:.0f} tok/s", flush=True)
    table = common.markdown_table(["slots", "decode attention", "kv bucket", "pallas splits", "steps per dispatch",
                                   "exit check every", "decode tok/s", "step ms", "roofline step ms",
                                   "of roofline", "prefill tok/s", "slot utilization"], rows)
    notes = ""
    if args.profile:
        slots, variant, k, e = runs[-1]
        attention, bucket, *splits = variant.split(":")
        new = min(args.new, 256)
        try:  # the table above is the run's result: a profiler that fails (no CUPTI) loses nothing
            notes = profile(model, attention, bucket, int(splits[0]) if splits else None, slots, args.prompt,
                            new, k, e, args.profile)
        except Exception as e:
            notes = f"profile failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        notes += (f"\nsampling pass alone (fp32 log-softmax + Gumbel over {cfg.vocab_size:,} tokens, {slots} rows): "
                  f"{sampling_pass_ms(cfg.vocab_size, slots):.3f} ms")
    common.record(args.record, f"JaxEngine decode: {args.model}, {args.slots} sequences",
                  "python -m experiments.benchmarks.engine_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.model} random bf16 weights and KV cache, {args.slots} concurrent requests, {args.prompt}-token "
                  f"prompts, {args.new} new tokens each (EOS off, temperature 1.0), continuous batching; measured copy "
                  f"bandwidth {bw / 1e12:.2f} TB/s (read + write); XLA_FLAGS {xla_flags}", table, notes, group=common.ENGINES)


if __name__ == "__main__":
    main()
