"""LoRA against full fine-tuning on this machine, side by side in one run (alternating):

- the weight sync to vLLM CPU servers started with adapters enabled (ServerOptions.lora_rank):
  the full model's staged sync (vllm_engine/sync/push.push_to_servers: every tensor exported, every server
  reloads it) against the adapters' (sync/adapters.push_adapters: PEFT files written once, every
  server loads them at run time), each ending with the log-prob probe (waited for);
- the learner's update (one optimizer step on the same batch) and its train state (trained
  parameters + AdamW moments, bytes), full against LoRA at each rank.

    python -m experiments.benchmarks.lora_sync [--servers 2] [--layers 8] [--hidden 1024] [--ranks 8] \
        [--repeats 3] [--record BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from experiments.benchmarks import common
from rstar2_jax import models
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.models import flops, lora, tiny
from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def learner_row(model_dir, rank, batch, repeats):
    model = models.load_pretrained(model_dir)
    if rank:
        lora.attach(model, lora.LoRAConfig(rank=rank), seed=0)
    learner = Learner(model, LearnerSettings(lr=1e-4, warmup_steps=0, token_entropy=False), own_params=True)
    times = []
    for i in range(repeats + 1):
        batch.old_logprobs = None
        start = time.perf_counter()
        learner.update(batch)
        jax.block_until_ready(learner.state.params)
        if i:  # the first compiles
            times.append(time.perf_counter() - start)
    return statistics.median(times), nbytes(learner.state.params) + nbytes(learner.state.opt_state)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ranks", default="8", help="adapter ranks, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    work = tempfile.mkdtemp(prefix="lora_sync_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model_dir = tiny.build_tiny_model(os.path.join(work, "model"), num_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=3 * args.hidden)
    full = models.load_pretrained(model_dir)
    params = flops.param_count(full.cfg)
    adapted = {r: lora.attach(models.load_pretrained(model_dir), lora.LoRAConfig(rank=r), seed=0) for r in ranks}
    python = common.vllm_python()
    servers = [VLLMServer(model_dir, ServerOptions(port=free_port(), dtype="float32", max_model_len=512,
                                                   cpu_kv_cache_gib=1, lora_rank=max(ranks)), python=python,
                          log_path=os.path.join(work, f"server{i}.log")).start() for i in range(args.servers)]
    syncs = {"full": []} | {r: [] for r in ranks}
    try:
        for s in servers:
            s.wait_ready(timeout=900)
        kw = dict(sync_dir=work, probe="wait")
        engines = {"full": [VLLMEngine(s.url, full, **kw) for s in servers]}
        engines |= {r: [VLLMEngine(s.url, adapted[r], **kw) for s in servers] for r in ranks}
        version = 0
        for i in range(args.repeats + 1):  # the first round warms up (pages, compiled probes)
            for key, group in engines.items():  # alternating, side by side
                version += 1
                params_of = full if key == "full" else adapted[key]
                report = push_to_servers(group, params_of, version)
                assert report.ok, report.error
                if i:
                    syncs[key].append(report)
    except BaseException:
        for s in servers:
            print(f"--- {s.log_path}\n" + "".join(open(s.log_path, errors="replace").readlines()[-40:]))
        raise
    finally:
        for s in servers:
            s.stop()
    rng = np.random.default_rng(0)
    rows_ = [rng.integers(1, 300, 256).tolist() for _ in range(8)]
    batch = make_batch(rows_, [[0] * 32 + [1] * 224] * 8, [[-5.0] * 256] * 8, [1.0, -1.0] * 4, pad_multiple=32)
    learn = {"full": learner_row(model_dir, 0, batch, args.repeats)}
    learn |= {r: learner_row(model_dir, r, batch, args.repeats) for r in ranks}
    shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    full_sync, full_update, full_state = med(x.total_s for x in syncs["full"]), *learn["full"]
    rows = []
    for key in ["full", *ranks]:
        r, (update_s, state) = syncs[key], learn[key]
        sync_s = med(x.total_s for x in r)
        rows.append([("full fine-tuning" if key == "full" else f"LoRA rank {key} (all 7 projections)"),
                     f"{r[0].bytes / 1e6:.2f}", f"{sync_s:.3f} ({sync_s / full_sync:.3f}x)",
                     f"{med(x.export_s for x in r):.3f} / {med(x.reload_s - x.export_s for x in r):.3f} / "
                     f"{med(x.probe_s for x in r):.3f}",
                     f"{update_s:.3f} ({update_s / full_update:.2f}x)", f"{state / 1e6:.1f} ({state / full_state:.3f}x)"])
    table = common.markdown_table(["trained", "sync bytes, MB", "sync to every server, s (vs full)",
                                   "of it: export / reload or load / probe, s",
                                   "learner update, s (vs full)", "train state, MB (vs full)"], rows)
    common.record(args.record, f"LoRA against full fine-tuning: the sync to {args.servers} vLLM CPU servers and the "
                  "learner's update (issue 49)",
                  common.command_line("experiments.benchmarks.lora_sync", argv),
                  f"random model, {params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}), float32; "
                  f"servers started with --enable-lora (max rank {max(ranks)}); {args.repeats} syncs each after a "
                  "warm-up round, alternating, each with its probe waited for; update: one optimizer step on 8 rows "
                  "of 256 tokens, median of the same repeats after the compiling one; train state: trained "
                  "parameters and AdamW moments", table, group=common.WEIGHT_SYNC)


if __name__ == "__main__":
    main()
