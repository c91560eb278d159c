"""Multi-turn rollouts on the JaxEngine with and without KV reuse between turns (CPU).

    python -m experiments.benchmarks.kv_reuse_cpu [--trajectories 8 --turns 10 --slots 8] [--record BENCHMARKS.md]

Each trajectory has `--turns` turns: the engine samples `--turn_tokens` tokens (EOS disabled),
then a `--tool_tokens`-token tool response is appended and the next turn starts, as in the agent
loop. Without reuse every turn prefills its whole trajectory again; with `reuse_kv` only the new
tokens. KV stays in a slot only until the slot is needed: with more live trajectories than
slots, waiting requests take the freed slots and little is reused (size slots to the
trajectories in flight). The two variants alternate `--repeats` times in one run (a shared
machine drifts); each run times the workload's second pass in one engine (the first compiles);
the table gives prefill tokens (exact), prefill device time and wall time (medians).
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


async def _workload(model, tokenizer, reuse: bool, args) -> dict[str, float]:
    from rstar2_jax.rollout.engines import JaxEngine
    from rstar2_jax.rollout.sampling import SamplingParams

    max_len = args.prompt_tokens + args.turns * (args.turn_tokens + args.tool_tokens) + 1
    sampling = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0)

    async def trajectory(engine, i, session):
        prompt = [(7 * i + j) % 250 + 1 for j in range(args.prompt_tokens)]
        for t in range(args.turns):
            c = await engine.generate(prompt, sampling, session=session)
            await asyncio.sleep(args.tool_s)  # the tool call: the slot has nothing to do meanwhile
            prompt = prompt + c.token_ids + [(3 * t + j) % 250 + 1 for j in range(args.tool_tokens)]

    async with JaxEngine(model, tokenizer, slots=args.slots, max_len=max_len, eos_ids=(), reuse_kv=reuse) as engine:
        # the same workload once untimed: every shape it meets is compiled (jit caches are per engine)
        await asyncio.gather(*(trajectory(engine, i, ("warm", i)) for i in range(args.trajectories)))
        before = dataclasses.replace(engine.stats)
        start = time.perf_counter()
        await asyncio.gather(*(trajectory(engine, i, ("timed", i)) for i in range(args.trajectories)))
        seconds = time.perf_counter() - start
        delta = engine.stats.since(before)
        return {"seconds": seconds, "prefill_tokens": delta.prefill_tokens, "reused_tokens": delta.reused_tokens,
                "prefill_s": delta.prefill_s, "decode_s": delta.decode_s}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a shape of experiments.benchmarks.common.SHAPES")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=512)
    p.add_argument("--turn_tokens", type=int, default=32)
    p.add_argument("--tool_tokens", type=int, default=96)
    p.add_argument("--tool_s", type=float, default=0.02, help="simulated tool latency between turns")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)

    from rstar2_jax import models
    from rstar2_jax.models import tiny
    from rstar2_jax.models.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_pretrained(tiny.build_tiny_model(tempfile.mkdtemp()))
    model = models.Decoder(common.shape(args.model), dtype=jnp.float32, rngs=nnx.Rngs(0))
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for reuse in (False, True):
            runs[reuse].append(asyncio.run(_workload(model, tokenizer, reuse, args)))
    rows = []
    for reuse in (False, True):
        r = runs[reuse]
        rows.append(("reuse_kv" if reuse else "re-prefill every turn", f"{r[0]['prefill_tokens']:,}",
                     f"{r[0]['reused_tokens']:,}", f"{statistics.median(x['prefill_s'] for x in r):.2f}",
                     f"{statistics.median(x['seconds'] for x in r):.2f}"))
    ratio = statistics.median(x["seconds"] for x in runs[False]) / statistics.median(x["seconds"] for x in runs[True])
    config = (f"model {args.model}, {args.trajectories} trajectories x {args.turns} turns, {args.slots} slots, "
              f"prompt {args.prompt_tokens}, {args.turn_tokens} sampled + {args.tool_tokens} tool tokens per turn, "
              f"{args.tool_s * 1000:.0f} ms tool latency, "
              f"{args.repeats} alternating repeats (median)")
    command = "python -m experiments.benchmarks.kv_reuse_cpu " + " ".join(sys.argv[1:] if argv is None else argv)
    table = common.markdown_table(["variant", "prefill tokens", "reused tokens", "prefill s", "wall s"], rows)
    common.record(args.record, "JaxEngine KV reuse between turns (CPU)", command.strip(), config, table,
                  notes=f"Wall-time ratio re-prefill / reuse: {ratio:.2f}x.")


if __name__ == "__main__":
    main()
