"""Weight sync to several vLLM CPU servers, three ways side by side in one run (alternating):

- whole export: every tensor cast and laid out, one safetensors file written (save_pretrained),
  then every server reloads it in parallel (the sync before issue 38);
- buckets: `vllm_engine/sync/push.push_to_servers`, the export written bucket by bucket (whole decoder
  layers, straight into reused files), in each `--swap` mode: streamed (each server paused
  before its first reload, each bucket reloaded while the next is written, the trainer waiting
  for the log-prob probes: the sync before issue 47) and staged (the servers generate through the
  export, then each stops for one reload of the whole export; the probes deferred: their verdict
  comes with the next sync, so the trainer does not wait for them); and background: staged with
  `rollout.vllm.sync_wait=export` (vllm_engine/sync/background.py), where the trainer waits only for the
  export and the reload lands behind it;
- reload alone: every server reloads an export already written (the floor a sync can reach
  without a faster path into vLLM).

And the export alone, no servers: the bucket writer's rate (GB/s) against a plain memory copy of
the same bytes on this host.

    python -m experiments.benchmarks.vllm_sync_servers [--servers 2] [--layers 8] [--hidden 2048] \
        [--repeats 3] [--bucket_mb 512] [--sync files|pull] [--swap streamed,staged] [--record BENCHMARKS.md]

--sync pull puts a weight fetcher beside each server (vllm_engine/sync/pull.py): the servers reload a copy
they pulled over HTTP instead of the trainer's file (no per-bucket reload then).

Each server is a real vLLM CPU server (.venv-vllm) started from a random model of the given size
(the tiny architecture: head_dim 32, vocabulary 320); every sync ends with the log-prob probe.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from experiments.benchmarks import common
from rstar2_jax import models
from rstar2_jax.models import checkpoint, flops, tiny
from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
from rstar2_jax.rollout.engines.vllm_engine.modes import Probe, Reload
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import probe_logprobs
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port
from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.vllm_engine.sync import export as weight_export


SWAP_ROWS = {"streamed": "streamed: each reloaded while the next is written, probes waited for",
             "staged": "staged: every bucket in, then one reload per server; probes deferred",
             "background": "staged, sync_wait=export: the trainer waits for the export only, the reload lands "
                           "behind it"}


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def whole_export(engines, model, version, work):
    """save_pretrained of the whole model, then every server reloads it in parallel: (total, export)."""
    start = time.perf_counter()
    target = os.path.join(work, f"whole_v{version}")
    checkpoint.save_pretrained(model, target, tokenizer_dir=None)
    export_s = time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(lambda e: e._reload(target, version), engines))
        for e in engines:
            e.version = version
        reference = probe_logprobs(model, engines[0].probe_tokens)  # the same probes as push_to_servers
        list(pool.map(lambda e: e.check_sync(model, reference), engines))
    total = time.perf_counter() - start
    shutil.rmtree(target, ignore_errors=True)
    return total, export_s


def reload_alone(engines):
    """Every server reloads the newest whole export in parallel: the slowest one's seconds."""
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        return max(pool.map(lambda e: timed(e._reload, e._synced_dir, e.version), engines))


def export_alone(model, bucket_bytes, work, repeats):
    """The bucket writer alone, a plain copy of as many bytes, and the writer's transposing copy
    alone (the MLP's largest weight, anonymous memory, warm) on one thread and on the export's
    threads: (GB/s, GB/s, GB/s one thread, GB/s, buckets). The export runs at a share of this
    host's memory bandwidth at the time, which on a shared VM moves with its neighbours: the
    figures side by side say which."""
    nbytes, rate, buckets = common.weight_export_rate(model, None, bucket_bytes, os.path.join(work, "export_alone"),
                                                      repeats)
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    copy = min(timed(np.copyto, dst, src) for _ in range(3))
    w = np.random.default_rng(0).random((model.cfg.intermediate_size, model.cfg.hidden_size), np.float32)
    out = np.empty(w.shape[::-1], np.float32)
    moved = {}
    threads = weight_export.export_threads()
    for n in (1, threads):  # write_bucket's copy of a linear weight, ours [in, out] to HF's [out, in]
        weight_export.copy_to_hf(out, w, True, n)
        moved[n] = min(timed(weight_export.copy_to_hf, out, w, True, n) for _ in range(3))
    return rate, nbytes / copy / 1e9, w.nbytes / moved[1] / 1e9, w.nbytes / moved[threads] / 1e9, buckets


def export_variants(model, bucket_bytes, work, widths, threads, rounds):
    """The export alone at each strip width of its host transpose and each thread count,
    alternating per round."""
    kept = weight_export.STRIP_ROWS, weight_export.MAX_EXPORT_THREADS
    try:
        for r in range(rounds):
            for rows in widths:
                for n in threads:
                    weight_export.STRIP_ROWS, weight_export.MAX_EXPORT_THREADS = rows, n
                    export, copy, transpose1, transpose, _ = export_alone(model, bucket_bytes, work, 3)
                    print(f"round {r}, strips of {rows} rows, {weight_export.export_threads()} thread(s): export "
                          f"{export:.2f} GB/s, its transposing copy alone {transpose1:.2f} GB/s on one thread, "
                          f"{transpose:.2f} on the export's, plain memory copy {copy:.2f} GB/s", flush=True)
    finally:
        weight_export.STRIP_ROWS, weight_export.MAX_EXPORT_THREADS = kept


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket_mb", default="512", help="bucket sizes to compare, comma-separated (MiB)")
    p.add_argument("--sync", choices=("files", "pull"), default="files")
    p.add_argument("--swap", default="streamed,staged,background", help="swap modes to compare, comma-separated "
                   "(streamed waits for the probes, staged defers them, background: staged with sync_wait=export)")
    p.add_argument("--strips", default="", help="only the export alone, no servers: these widths of the host "
                   "transpose's strips (weight_export.STRIP_ROWS), comma-separated, alternating --repeats rounds")
    p.add_argument("--threads", default="", help="only the export alone, no servers: these most threads of its "
                   "copy (weight_export.MAX_EXPORT_THREADS), comma-separated, alternating --repeats rounds")
    p.add_argument("--sync_threads", default="", help="with servers: each sync at each of these most threads of "
                   "the export's copy (weight_export.MAX_EXPORT_THREADS), comma-separated, alternating")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="vllm_sync_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model_dir = tiny.build_tiny_model(os.path.join(work, "model"), num_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=3 * args.hidden)
    model = models.load_pretrained(model_dir)
    params = flops.param_count(model.cfg)
    sizes = [int(x) << 20 for x in args.bucket_mb.split(",")]
    if args.strips or args.threads:
        try:
            return export_variants(model, sizes[0], work,
                                   [int(x) for x in (args.strips or str(weight_export.STRIP_ROWS)).split(",")],
                                   [int(x) for x in (args.threads or str(weight_export.MAX_EXPORT_THREADS)).split(",")],
                                   args.repeats)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    export_rate, copy_rate, transpose1_rate, transpose_rate, n_buckets = export_alone(model, sizes[0], work, args.repeats)
    kept_threads = weight_export.MAX_EXPORT_THREADS
    python = common.vllm_python()
    servers = [VLLMServer(model_dir, ServerOptions(port=free_port(), dtype="float32", max_model_len=512,
                                                   cpu_kv_cache_gib=1), python=python,
                          log_path=os.path.join(work, f"server{i}.log")).start() for i in range(args.servers)]
    fetchers = []
    try:
        for s in servers:
            s.wait_ready(timeout=900)
        if args.sync == "pull":
            from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher
            fetchers = [WeightFetcher(os.path.join(work, f"pulled{i}")) for i in range(len(servers))]
        kw = dict(sync_dir=work, bucket_bytes=sizes[0])
        engines = [VLLMEngine(s.url, model, sync="pull", fetch_url=f.url, **kw) for s, f in zip(servers, fetchers)] \
            if fetchers else [VLLMEngine(s.url, model, **kw) for s in servers]
        whole, whole_export_s, floor = [], [], []
        swaps = args.swap.split(",")
        thread_counts = [int(x) for x in args.sync_threads.split(",")] if args.sync_threads else [None]
        bucketed = {(size, swap, n): [] for size in sizes for swap in swaps for n in thread_counts}
        version = 0
        for size in sizes:
            for e in engines:
                e.bucket_bytes = size
            for i in range(args.repeats + 2):  # the first two syncs of a size allocate the two slots' pages
                if i >= 2:
                    version += 1
                    total, export_s = whole_export(engines, model, version, work)
                    whole.append(total)
                    whole_export_s.append(export_s)
                for swap, n in [(swap, n) for swap in swaps for n in thread_counts]:  # alternating, side by side
                    for e in engines:
                        e.reload = Reload.STAGED if swap == "background" else Reload(swap)
                        e.probe = Probe.WAIT if swap == "streamed" else Probe.DEFERRED
                    version += 1
                    weight_export.MAX_EXPORT_THREADS = n or kept_threads
                    start = time.perf_counter()
                    if swap == "background":  # the trainer's wait ends at the export; then the landing is awaited
                        background_sync.push_in_background(engines, model, version)
                        waited = time.perf_counter() - start
                        report = background_sync.settle(engines)[-1]
                    else:
                        report = push_to_servers(engines, model, version)
                        waited = time.perf_counter() - start
                    weight_export.MAX_EXPORT_THREADS = kept_threads
                    assert report.ok, report.error
                    for e in engines:  # a deferred verdict: in a run the next update takes this time
                        e.probe_verdict()
                    if i >= 2:
                        bucketed[size, swap, n].append((report, waited))
                if i >= 2:
                    floor.append(reload_alone(engines))
    except BaseException:
        for s in servers:  # why a server failed is in its log, which goes with the work directory
            print(f"--- {s.log_path}\n" + "".join(open(s.log_path, errors="replace").readlines()[-40:]))
        raise
    finally:
        for s in servers:
            s.stop()
        for f in fetchers:
            f.close()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    gb = params * 4 / 1e9
    rows = [["whole export, then every server reloads it", f"{med(whole):.2f}", "",
             f"export {med(whole_export_s):.2f} s ({gb / med(whole_export_s):.2f} GB/s)",
             f"{med(whole) / med(floor):.2f}x"],
            *[[f"{r[0].buckets} bucket(s) of <= {size >> 20} MiB, {SWAP_ROWS[swap]}"
               + (f"; export on {n} thread(s)" if n else ""),
               f"{med(waits):.2f}",
               f"{med(x.paused_s for x in r):.2f} ({med(x.paused_s for x in r) / med(floor):.2f}x), from "
               f"{med(x.paused_from_s for x in r):.2f} s",
               f"export {med(x.export_s for x in r):.2f} s, all reloaded at {med(x.reload_s for x in r):.2f} s, "
               f"generating again at {med(x.resumed_s for x in r):.2f} s, probes {med(x.probe_s for x in r):.2f} s"
               + (" (after the sync returned)" if swap != "streamed" else "")
               + (f"; landed at {med(x.total_s for x in r):.2f} s" if swap == "background" else ""),
               f"{med(waits) / med(floor):.2f}x"]
              for (size, swap, n), pairs in bucketed.items() for r, waits in [tuple(zip(*pairs))]],
            ["reload alone (an export already written)", f"{med(floor):.2f}", "", "the slowest server", "1.00x"],
            [f"export alone, no servers ({n_buckets} bucket(s))", f"{gb / export_rate:.2f}", "",
             f"{export_rate:.2f} GB/s; plain memory copy {copy_rate:.2f} GB/s, its transposing copy alone "
             f"{transpose1_rate:.2f} GB/s on one thread, {transpose_rate:.2f} on {weight_export.export_threads()}", ""]]
    table = common.markdown_table(["sync to all servers", "the trainer waits, s (median)",
                                   "a server's longest pause, s (vs reload alone)", "parts",
                                   "trainer's wait vs reload alone"], rows)
    common.record(args.record, f"vLLM weight sync to {args.servers} CPU servers ({args.sync}): staged against "
                  "streamed, and a whole export",
                  common.command_line("experiments.benchmarks.vllm_sync_servers", argv),
                  f"random model, {params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}), "
                  f"{gb:.2f} GB float32 safetensors in /dev/shm, {args.repeats} syncs each way after two warm-up "
                  "syncs, alternating; every sync ends with the log-prob probe"
                  + (", each server's fetcher copying the export over HTTP" if args.sync == "pull" else ""), table,
                  group=common.WEIGHT_SYNC)


if __name__ == "__main__":
    main()
