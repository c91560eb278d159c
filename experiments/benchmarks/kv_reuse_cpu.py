"""Multi-turn rollouts on the JaxEngine: KV reuse between turns, slot rows vs paged KV (CPU).

    python -m experiments.benchmarks.kv_reuse_cpu [--trajectories 8 --turns 10 --slots 8] [--record BENCHMARKS.md]
    python -m experiments.benchmarks.kv_reuse_cpu --trajectories 32 --paged_slots 32 [--record BENCHMARKS.md]

Each trajectory has `--turns` turns: the engine samples `--turn_tokens` tokens (EOS disabled),
then a `--tool_tokens`-token tool response is appended and the next turn starts, as in the agent
loop. Without reuse every turn prefills its whole trajectory again; with `reuse_kv` only the new
tokens. With slot rows KV stays in a slot only until the slot is needed: with more live
trajectories than slots, waiting requests take the freed slots and little is reused.
`--paged_slots N` adds paged variants: N slots over the same KV memory as the rows
(`--slots` x max_len, in `--page_size` pages), so memory follows the tokens written and a
finished turn keeps only its pages. The variants alternate `--repeats` times in one run (a
shared machine drifts); each run times the workload's second pass in one engine (the first
compiles); the table gives prefill tokens (exact), preemptions, mean busy slots per decode step,
prefill device time and wall time (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time

import jax.numpy as jnp
from flax import nnx

from experiments.benchmarks import common


async def _workload(model, tokenizer, variant: dict, args) -> dict[str, float]:
    from rstar2_jax.rollout.engines import JaxEngine
    from rstar2_jax.rollout.engines.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0)

    async def trajectory(engine, i, session):
        prompt = [(7 * i + j) % 250 + 1 for j in range(args.prompt_tokens)]
        for t in range(args.turns):
            c = await engine.generate(prompt, sampling, session=session)
            await asyncio.sleep(args.tool_s)  # the tool call: the slot has nothing to do meanwhile
            prompt = prompt + c.token_ids + [(3 * t + j) % 250 + 1 for j in range(args.tool_tokens)]

    async with JaxEngine(model, tokenizer, max_len=_max_len(args), eos_ids=(), **variant) as engine:
        # the same workload once untimed: every shape it meets is compiled (jit caches are per engine)
        await asyncio.gather(*(trajectory(engine, i, ("warm", i)) for i in range(args.trajectories)))
        before = dataclasses.replace(engine.stats)
        start = time.perf_counter()
        await asyncio.gather(*(trajectory(engine, i, ("timed", i)) for i in range(args.trajectories)))
        seconds = time.perf_counter() - start
        delta = engine.stats.since(before)
        return {"seconds": seconds, "prefill_tokens": delta.prefill_tokens, "reused_tokens": delta.reused_tokens,
                "preemptions": delta.preemptions, "prefill_s": delta.prefill_s, "decode_s": delta.decode_s,
                "busy": delta.busy_slot_steps / max(1, delta.decode_steps)}


def _max_len(args) -> int:
    """`--headroom` x (the longest trajectory plus one), rounded up to whole pages: an RL run
    sizes max_len for its longest possible trajectory, and most are shorter."""
    from rstar2_jax.rollout.engines.jax_engine.kv_pages import pages_for

    need = args.headroom * (args.prompt_tokens + args.turns * (args.turn_tokens + args.tool_tokens) + 1)
    return pages_for(int(need), args.page_size) * args.page_size


def _variants(args) -> dict[str, dict]:
    rows = dict(slots=args.slots)
    out = {"rows, re-prefill every turn": dict(rows, reuse_kv=False), "rows, reuse_kv": dict(rows, reuse_kv=True)}
    if args.paged_slots:
        # the rows' memory, in pages
        paged = dict(slots=args.paged_slots, page_size=args.page_size,
                     kv_pages=args.slots * _max_len(args) // args.page_size)
        out["paged, re-prefill every turn"] = dict(paged, reuse_kv=False)
        out["paged, reuse_kv"] = dict(paged, reuse_kv=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a shape of rstar2_jax.models.shapes.SHAPES")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=512)
    p.add_argument("--turn_tokens", type=int, default=32)
    p.add_argument("--tool_tokens", type=int, default=96)
    p.add_argument("--tool_s", type=float, default=0.02, help="simulated tool latency between turns")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paged_slots", type=int, default=0, help="add paged variants with this many slots (0: none)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--headroom", type=float, default=1.0, help="max_len / the longest trajectory's length")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)

    from rstar2_jax import models
    from rstar2_jax.models import tiny
    from rstar2_jax.models.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_pretrained(tiny.build_tiny_model(tempfile.mkdtemp()))
    model = models.Decoder(common.shape(args.model), dtype=jnp.float32, rngs=nnx.Rngs(0))
    variants = _variants(args)
    runs = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, variant in variants.items():
            runs[name].append(asyncio.run(_workload(model, tokenizer, variant, args)))
    rows = []
    for name, variant in variants.items():
        r = runs[name]
        rows.append((name, variant["slots"], f"{r[0]['prefill_tokens']:,}", f"{r[0]['reused_tokens']:,}",
                     r[0]["preemptions"], f"{statistics.median(x['busy'] for x in r):.1f}",
                     f"{statistics.median(x['prefill_s'] for x in r):.2f}",
                     f"{statistics.median(x['seconds'] for x in r):.2f}"))
    wall = {name: statistics.median(x["seconds"] for x in r) for name, r in runs.items()}
    base = wall["rows, re-prefill every turn"]
    config = (f"model {args.model}, {args.trajectories} trajectories x {args.turns} turns, KV memory "
              f"{args.slots} x max_len {_max_len(args)} tokens ({args.headroom:g}x the longest trajectory), "
              f"prompt {args.prompt_tokens}, {args.turn_tokens} sampled + "
              f"{args.tool_tokens} tool tokens per turn, {args.tool_s * 1000:.0f} ms tool latency"
              + (f", pages of {args.page_size}" if args.paged_slots else "")
              + f", {args.repeats} alternating repeats (median)")
    command = "python -m experiments.benchmarks.kv_reuse_cpu " + " ".join(sys.argv[1:] if argv is None else argv)
    table = common.markdown_table(["variant", "slots", "prefill tokens", "reused tokens", "preemptions",
                                   "mean busy slots", "prefill s", "wall s"], rows)
    notes = "Wall time, re-prefilling slot rows / each variant: " + ", ".join(
        f"{name} {base / t:.2f}x" for name, t in wall.items() if name != "rows, re-prefill every turn") + "."
    title = "JaxEngine KV reuse between turns, slot rows vs paged KV (CPU)" if args.paged_slots else \
        "JaxEngine KV reuse between turns (CPU)"
    common.record(args.record, title, command.strip(), config, table, notes=notes, group=common.ENGINES)


if __name__ == "__main__":
    main()
