"""The engine's longest pause per weight sync, on 8 fake CPU devices (issue 70 items 3 and 5).

    python -m experiments.benchmarks.sync_pause_cpu --syncs 8 [--record BENCHMARKS.md]

The learner's float32 weights live FSDP-split over devices 0-3. An embedded JaxEngine decodes
without a break (16 slots kept busy, 16 steps a dispatch) and, every --interval seconds, takes a
sync: the weights resharded onto its mesh (`processes.local_copy`, what the trainer does), then
`update_weights`. On a CPU `device_put` copies before it returns, so the copy runs in a thread (the
engine's event loop goes on, as it does while a GPU's copy engines work) and the engine is given
weights that have landed: rollout.jax.swap's two settings act alike here. Placements, one process,
side by side:

- colocated: the engine on the learner's devices 0-3 (tensor 4), today's default;
- own: the engine on devices 4-7 of its own;
- own-swap_only: the copy made before the sync starts: the swap alone, what a sync costs the
  engine when the copy takes none of its compute (a GPU's copy engines).

Figures: the sync (start to the copy's arrays all ready), and the engine's longest gap between
two chunks' reads during a sync (from its start to one chunk after it landed) against the median
gap outside syncs. The target (issue 70): a pause of one swap, not of a copy. Fake devices share
this machine's cores, so a copy competes with decoding for the same CPU: a lower bound on what
separate devices would gain, not an NVLink figure.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.benchmarks import common  # noqa: E402
from experiments.benchmarks.engine_decode import _NoTokenizer  # noqa: E402
from rstar2_jax.core import processes  # noqa: E402
from rstar2_jax.core import sharding  # noqa: E402
from rstar2_jax.models import Decoder  # noqa: E402
from rstar2_jax.models.tiny import tiny_config  # noqa: E402
from rstar2_jax.rollout.engines import JaxEngine, engine_mesh  # noqa: E402
from rstar2_jax.rollout.engines.sampling import SamplingParams  # noqa: E402

PLACEMENTS = {"colocated": ("shared", False), "own": ("own", False), "own-swap_only": ("own", True)}


async def _run_placement(model, learner_params, mesh, precopied, args) -> dict:
    engine = JaxEngine(model, _NoTokenizer(), slots=args.slots, max_len=args.prompt + args.max_tokens + 16, eos_ids=(),
                       mesh=mesh, decode_steps=args.decode_steps)
    reads: list[float] = []
    apply = engine.decoder._apply

    async def timed_apply(eng, loop, chunk):  # the chunk's tokens read: the engine's heartbeat
        await apply(eng, loop, chunk)
        reads.append(time.monotonic())

    engine.decoder._apply = timed_apply
    engine.precompile([args.prompt])
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    stop = asyncio.Event()

    async def client(i):  # keeps one slot busy until told to stop
        while not stop.is_set():
            await engine.generate([(7 * i + j) % 250 + 1 for j in range(args.prompt)], sampling)

    targets = sharding.param_shardings(learner_params, mesh)
    syncs = []
    loop = asyncio.get_running_loop()
    async with engine:
        clients = [asyncio.ensure_future(client(i)) for i in range(args.slots)]
        await asyncio.sleep(args.warmup)
        start, first_tokens = time.monotonic(), engine.stats.busy_slot_steps
        for version in range(1, args.syncs + 1):
            await asyncio.sleep(args.interval)
            # the copy in a thread: on a CPU device_put copies before it returns, which would stall
            # the engine's event loop (on a GPU it is dispatched and runs on the copy engines)
            copy = lambda: jax.block_until_ready(processes.local_copy(learner_params, shardings=targets))  # noqa: E731
            if precopied:  # the swap alone: its copy is on the engine's devices before it is given,
                weights = await loop.run_in_executor(None, copy)
                seen = len(reads)
                while len(reads) < seen + 2:  # and two chunks run after it, so no gap holds the copy
                    await asyncio.sleep(0.005)
            t0 = time.monotonic()
            if not precopied:
                weights = await loop.run_in_executor(None, copy)
            engine.update_weights(weights, version=version)
            landed = time.monotonic()
            await engine.weights_at_least(version)
            syncs.append((t0, landed, time.monotonic()))
        await asyncio.sleep(args.interval)
        seconds, made = time.monotonic() - start, engine.stats.busy_slot_steps - first_tokens
        stop.set()
        await asyncio.gather(*clients)
    gaps = [(a, b) for a, b in zip(reads, reads[1:]) if a >= start]
    typical = statistics.median(b - a for a, b in gaps if not any(t0 - 1e-3 <= b and a <= end for t0, _, end in syncs))
    longest = []
    for t0, landed, taken in syncs:
        after = min((r for r in reads if r > max(landed, taken)), default=taken)  # one chunk after it took over
        longest.append(max((b - a for a, b in gaps if b >= t0 and a <= after), default=0.0))
    return dict(sync_ms=statistics.median((landed - t0) * 1e3 for t0, landed, _ in syncs),
                typical_ms=typical * 1e3, pause_median_ms=statistics.median(longest) * 1e3,
                pause_max_ms=max(longest) * 1e3, tokens_per_s=made / seconds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncs", type=int, default=8)
    p.add_argument("--interval", type=float, default=0.6, help="seconds between syncs")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of decoding before the first sync")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=384)
    p.add_argument("--decode_steps", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256, help="the model's width (4 layers, vocabulary 8,192)")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--record")
    args = p.parse_args(argv)
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"needs 8 devices (fake CPU ones: XLA_FLAGS=--xla_force_host_platform_device_count=8), "
                         f"got {len(devices)}")
    cfg = tiny_config(vocab_size=8192, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=args.hidden // 8)
    model = Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    learner_mesh = sharding.make_mesh(data=1, fsdp=4, tensor=1, devices=devices[:4])
    state = nnx.state(model, nnx.Param)
    learner_params = jax.device_put(state, sharding.param_shardings(state, learner_mesh))
    megabytes = sum(x.nbytes for x in jax.tree.leaves(learner_params)) / 1e6
    meshes = {"shared": engine_mesh(devices[:4]), "own": engine_mesh(devices[4:])}
    rows = []
    for name in args.placements.split(","):
        where, precopied = PLACEMENTS[name]
        r = asyncio.run(_run_placement(model, learner_params, meshes[where], precopied, args))
        print(f"{name}: {r}", flush=True)
        rows.append([name, f"{r['sync_ms']:.1f}", f"{r['typical_ms']:.1f}", f"{r['pause_median_ms']:.1f}",
                     f"{r['pause_max_ms']:.1f}", f"{r['tokens_per_s']:.0f}"])
    table = common.markdown_table(["engine", "sync ms (median)", "chunk gap ms, no sync (median)",
                                   "longest gap in a sync, ms (median)", "longest gap in a sync, ms (max)",
                                   "decode tok/s over the run"], rows)
    common.record(args.record, "JaxEngine: the pause per weight sync on 8 fake CPU devices (issue 70)",
                  "python -m experiments.benchmarks.sync_pause_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.hidden}-wide 4-layer Qwen3 shape ({megabytes:.0f} MB float32), learner FSDP over devices 0-3; "
                  f"{args.slots} slots kept busy, {args.decode_steps} steps a dispatch; {args.syncs} syncs "
                  f"{args.interval} s apart", table, group=common.ENGINES)


if __name__ == "__main__":
    main()
