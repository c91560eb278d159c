"""Weight-sync cost: learner parameters -> HF safetensors in /dev/shm -> a fresh process's device.

    python -m experiments.benchmarks.weight_sync --model qwen3_1p7b [--dir /dev/shm/rstar2_sync] [--record BENCHMARKS.md]

This is the path an external engine (vLLM) reloads from. Export: fp32 master weights on the
device, cast to bf16, copied to the host and written (`save_pretrained`). Reload: a new Python
process runs `load_pretrained(dtype=bf16)` onto its device (time inside the process, imports
excluded, and wall time of the whole process). GB/s are the bf16 bytes over each time, next to
the host memory-copy rate measured in the same run (a numpy copy of 1 GiB, read + write).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from rstar2_jax.models import Decoder, flops, save_pretrained

_RELOAD = """
import json, sys, time
import jax, jax.numpy as jnp
from rstar2_jax.models import load_pretrained
start = time.perf_counter()
model = load_pretrained(sys.argv[1], dtype=jnp.bfloat16, progress=False)
jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
print(json.dumps({"load_s": time.perf_counter() - start}))
"""


def host_copy_rate(gib: float = 1.0) -> float:
    src = np.random.default_rng(0).integers(0, 255, int(gib * 2 ** 30), dtype=np.uint8)
    dst = np.empty_like(src)
    t = common.median_seconds(lambda: np.copyto(dst, src), repeats=5)
    return 2 * src.nbytes / t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_1p7b")
    p.add_argument("--dir", default="/dev/shm/rstar2_weight_sync")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    cfg = common.shape(args.model)
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    nbytes = 2 * flops.param_count(cfg)
    copy_rate = host_copy_rate()
    shutil.rmtree(args.dir, ignore_errors=True)
    start = time.perf_counter()
    save_pretrained(model, args.dir, dtype=jnp.bfloat16)
    export_s = time.perf_counter() - start
    written = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RELOAD, args.dir], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    process_s = time.perf_counter() - start
    load_s = json.loads(out.stdout.strip().splitlines()[-1])["load_s"]
    shutil.rmtree(args.dir, ignore_errors=True)
    gbps = lambda s: f"{nbytes / s / 1e9:.2f}"
    rows = [["export (device fp32 -> bf16 safetensors)", f"{export_s:.2f}", gbps(export_s)],
            ["reload in a fresh process (load_pretrained)", f"{load_s:.2f}", gbps(load_s)],
            ["fresh process, wall (incl. Python + JAX start)", f"{process_s:.2f}", gbps(process_s)],
            ["host memory copy (numpy, read + write)", "", f"{copy_rate / 1e9:.1f}"]]
    table = common.markdown_table(["stage", "seconds", "GB/s"], rows)
    common.record(args.record, f"Weight sync: {args.model} via safetensors in {os.path.dirname(args.dir)}",
                  "python -m experiments.benchmarks.weight_sync " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.model} random weights, {flops.param_count(cfg) / 1e9:.2f}B params, {written / 1e9:.2f} GB "
                  f"of bf16 safetensors written", table, group=common.WEIGHT_SYNC)


if __name__ == "__main__":
    main()
