"""JaxEngine decode throughput on the tiny model at several slot counts (CPU).

    python -m experiments.benchmarks.jax_engine_cpu --slots 1,2,4,8,16 --requests 64 --max_tokens 128
    python -m experiments.benchmarks.jax_engine_cpu --slots 1,16,64 --decode_steps 1,16 --rounds 3

Every request samples exactly --max_tokens tokens (EOS disabled), so the figure is decode
throughput with continuous batching, prefill included. Several --decode_steps (tokens per
dispatch; 1 is one host round trip per token) are measured side by side, alternating in each
round, so the machine's noise falls on both. Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time

import jax


async def _measure(model, tokenizer, slots, requests, max_tokens, prompt_len, decode_steps=1):
    from rstar2_jax.rollout.engines import JaxEngine
    from rstar2_jax.rollout.engines.sampling import SamplingParams

    prompts = [[(7 * i + j) % 250 + 1 for j in range(prompt_len)] for i in range(requests)]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    async with JaxEngine(model, tokenizer, slots=slots, max_len=prompt_len + max_tokens + 1, eos_ids=(),
                         decode_steps=decode_steps) as eng:
        await asyncio.gather(*(eng.generate(p, sampling) for p in prompts[:slots]))  # compile
        start = time.perf_counter()
        outs = await asyncio.gather(*(eng.generate(p, sampling) for p in prompts))
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"slots": slots, "decode_steps": decode_steps, "requests": requests, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--decode_steps", default="1", help="decode steps per dispatch, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each measuring every setting once")
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args(argv)

    from rstar2_jax import models
    from rstar2_jax.models import tiny
    from rstar2_jax.models.tokenizer import Tokenizer

    model_dir = tiny.build_tiny_model(tempfile.mkdtemp())
    model, tokenizer = models.load_pretrained(model_dir), Tokenizer.from_pretrained(model_dir)
    cfg = model.cfg
    print(f"tiny Qwen3: layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads} vocab={cfg.vocab_size}; "
          f"device={jax.devices()[0].platform} cpus={os.cpu_count()} {platform.machine()}")
    results = []
    for rnd in range(args.rounds):
        for slots in [int(s) for s in args.slots.split(",")]:
            for k in [int(s) for s in args.decode_steps.split(",")]:
                r = asyncio.run(_measure(model, tokenizer, slots, args.requests, args.max_tokens, args.prompt_len, k))
                results.append({**r, "round": rnd})
                print(f"round {rnd} slots {slots:3d} decode_steps {k:3d}: {r['tokens']} tokens in {r['seconds']:.2f} s"
                      f" = {r['tokens_per_s']:.0f} tokens/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
