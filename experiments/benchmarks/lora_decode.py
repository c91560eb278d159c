"""Decoding under a LoRA adapter on a vLLM CPU server, by how the adapter was loaded, side by side
in one run (alternating): the base model, an adapter loaded plainly (what adapter_sync does), and
the same adapter loaded with `load_inplace` (what it did before 2026-11-29).

vLLM 0.32 keeps `load_inplace` on the adapter's request, and its worker reloads an in-place
adapter from its files at every engine step that serves it (vllm/lora/worker_manager.py,
LRUCacheWorkerLoRAManager.add_adapter): this measures what that costs, for one request and for a
batch of concurrent ones (one reload per step serves the whole batch).

    python -m experiments.benchmarks.lora_decode [--layers 4] [--hidden 512] [--rank 32] \
        [--tokens 128] [--batch 8] [--repeats 3] [--record BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

from experiments.benchmarks import common
from rstar2_jax import models
from rstar2_jax.models import flops, lora, tiny
from rstar2_jax.models.adapter_files import write_adapter
from rstar2_jax.rollout.engines.vllm_engine.sync.adapters import gathered_adapters
from rstar2_jax.rollout.engines.vllm_engine.client import AsyncVLLMClient, VLLMClient
from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port


async def decode_s(client: AsyncVLLMClient, model: str, tokens: int, batch: int) -> float:
    """Wall seconds for `batch` concurrent greedy completions of `tokens` tokens each."""
    body = {"model": model, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    await asyncio.gather(*(client.request("POST", "/v1/completions", {**body, "prompt": [1, 2, 3, 4 + i]})
                           for i in range(batch)))
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="concurrent requests of the batched rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="lora_decode_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model_dir = tiny.build_tiny_model(os.path.join(work, "model"), num_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=3 * args.hidden)
    cfg = lora.LoRAConfig(rank=args.rank)
    adapted = lora.attach(models.load_pretrained(model_dir), cfg, seed=0)
    params = flops.param_count(adapted.cfg)
    for name in ("plain", "inplace"):  # the same weights in two directories, one per loading
        write_adapter(gathered_adapters(adapted), cfg, os.path.join(work, name), base_model=model_dir)
    adapter_mb = sum(os.path.getsize(os.path.join(work, "plain", f)) for f in os.listdir(os.path.join(work, "plain"))) / 1e6
    server = VLLMServer(model_dir, ServerOptions(port=free_port(), dtype="float32", max_model_len=1024,
                                                 cpu_kv_cache_gib=1, lora_rank=args.rank),
                        python=common.vllm_python(),
                        log_path=os.path.join(work, "server.log")).start()
    kinds = {"base model": model_dir, "adapter loaded plainly": "plain", "adapter loaded in place": "inplace"}
    times: dict[tuple[str, int], list[float]] = {(k, b): [] for k in kinds for b in (1, args.batch)}
    try:
        server.wait_ready(timeout=900)
        sync = VLLMClient(server.url)
        sync.request("POST", "/v1/load_lora_adapter", {"lora_name": "plain", "lora_path": os.path.join(work, "plain")})
        sync.request("POST", "/v1/load_lora_adapter", {"lora_name": "inplace", "load_inplace": True,
                                                       "lora_path": os.path.join(work, "inplace")})

        async def rounds():
            client = AsyncVLLMClient(server.url)
            for i in range(args.repeats + 1):  # the first round warms up
                for batch in (1, args.batch):
                    for kind, model in kinds.items():  # alternating, side by side
                        t = await decode_s(client, model, args.tokens, batch)
                        if i:
                            times[(kind, batch)].append(t)
            await client.close()
        asyncio.run(rounds())
    except BaseException:
        print("".join(open(server.log_path, errors="replace").readlines()[-40:]))
        raise
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for batch in (1, args.batch):
        base = statistics.median(times[("base model", batch)])
        for kind in kinds:
            t = statistics.median(times[(kind, batch)])
            rows.append([kind, batch, f"{t:.3f}", f"{batch * args.tokens / t:.1f}", f"{t / base:.2f}x"])
    table = common.markdown_table(["served", "concurrent requests", "wall, s (median)", "tokens/s",
                                   "vs the base"], rows)
    common.record(args.record, "LoRA decoding on a vLLM CPU server: an adapter loaded plainly against in place",
                  common.command_line("experiments.benchmarks.lora_decode", argv),
                  f"random model, {params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}), float32; "
                  f"adapter rank {args.rank} on all 7 projections ({adapter_mb:.2f} MB of PEFT files); greedy, "
                  f"{args.tokens} tokens per request (ignore_eos), {args.repeats} rounds after a warm-up one, "
                  "alternating; one server, --enable-lora", table, group=common.WEIGHT_SYNC)


if __name__ == "__main__":
    main()
