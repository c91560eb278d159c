"""Weight sync to several vLLM servers: one export per server, one server after another (how the
scheduler synced before), against one shared export reloaded by every server in parallel
(`vllm_engine.push_to_servers`, what the trainer does now). Both in one run, alternating.

    python -m experiments.benchmarks.vllm_sync_servers [--servers 2] [--layers 8] [--hidden 512] \
        [--repeats 3] [--sync files|pull] [--record BENCHMARKS.md]

--sync pull puts a weight fetcher beside each server (weight_pull.py): the servers reload a copy
they pulled over HTTP instead of the trainer's file.

Each server is a real vLLM CPU server (.venv-vllm) started from a random model of the given size
(the tiny architecture: head_dim 32, vocabulary 320); a sync is export (safetensors into /dev/shm)
+ reload (`reload_weights` over HTTP, between pause and resume) + the log-prob probe.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time

from experiments.benchmarks import common
from rstar2_jax import models
from rstar2_jax.models import flops, tiny
from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine
from rstar2_jax.rollout.engines.vllm_server import ServerOptions, VLLMServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def one_by_one(engines, model, version):
    """Each engine exports its own copy and reloads it, in turn: (total, per-server times)."""
    per = [timed(e.update_weights, model, version) for e in engines]
    return sum(per), per


def shared(engines, model, version):
    """One export, every server reloads it in parallel: (total, export time, per-server reload times)."""
    start = time.perf_counter()
    export_s = timed(lambda: setattr(shared, "dir", engines[0].export(model, version)))
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        per = list(pool.map(lambda e: timed(e.load_export, shared.dir, version, model), engines))
    return time.perf_counter() - start, export_s, per


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync", choices=("files", "pull"), default="files")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="vllm_sync_")
    model_dir = tiny.build_tiny_model(os.path.join(work, "model"), num_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=3 * args.hidden)
    model = models.load_pretrained(model_dir)
    params = flops.param_count(model.cfg)
    python = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    servers = [VLLMServer(model_dir, ServerOptions(port=free_port(), dtype="float32", max_model_len=512,
                                                   cpu_kv_cache_gib=1), python=python,
                          log_path=os.path.join(work, f"server{i}.log")).start() for i in range(args.servers)]
    fetchers = []
    try:
        for s in servers:
            s.wait_ready(timeout=900)
        if args.sync == "pull":
            from rstar2_jax.rollout.engines.weight_pull import WeightFetcher
            fetchers = [WeightFetcher(os.path.join(work, f"pulled{i}")) for i in range(len(servers))]
        engines = [VLLMEngine(s.url, model, sync="pull", fetch_url=f.url) for s, f in zip(servers, fetchers)] \
            if fetchers else [VLLMEngine(s.url, model) for s in servers]
        seq_total, shared_total, export, reload_max, seq_per = [], [], [], [], []
        version = 0
        for _ in range(args.repeats):
            version += 1
            total, per = one_by_one(engines, model, version)
            seq_total.append(total)
            seq_per += per
            version += 1
            total, export_s, per = shared(engines, model, version)
            shared_total.append(total)
            export.append(export_s)
            reload_max.append(max(per))
    finally:
        for s in servers:
            s.stop()
        for f in fetchers:
            f.close()
    med = statistics.median
    rows = [["one export per server, one server after another", f"{med(seq_total):.3f}",
             f"per server {med(seq_per):.3f}"],
            ["one shared export, all servers reload in parallel", f"{med(shared_total):.3f}",
             f"export {med(export):.3f} + slowest reload {med(reload_max):.3f}"],
            ["ratio (one after another / shared)", f"{med(seq_total) / med(shared_total):.2f}x", ""]]
    table = common.markdown_table(["sync to all servers", "seconds (median)", "parts"], rows)
    common.record(args.record, f"Weight sync to {args.servers} vLLM CPU servers ({args.sync}): shared export vs one "
                  "per server",
                  common.command_line("experiments.benchmarks.vllm_sync_servers", argv),
                  f"random model, {params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}), "
                  f"float32 safetensors in /dev/shm, {args.repeats} syncs each way, alternating; sync = export + "
                  + ("the fetcher's HTTP copy + " if args.sync == "pull" else "")
                  + "reload_weights + log-prob probe", table)


if __name__ == "__main__":
    main()
