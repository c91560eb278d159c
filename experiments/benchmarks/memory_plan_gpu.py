"""`train --plan`'s memory lines against what JAX allocates on one GPU, and the bucket writer's
export rate there.

    python -m experiments.benchmarks.memory_plan_gpu [--models qwen3_0p6b,qwen3_1p7b] [--rows 8] [--seq 4096]

For each public shape (random weights): the run config of experiments/qwen3_0p6b_math.py (bf16
compute, remat full, cuDNN attention) with `rows` rows of `seq` positions in one micro-batch; the
plan's lines (rl/memory_plan.py) against XLA's memory_analysis() of the compiled update
(arguments: parameters + optimizer + batch; temporaries: gradients + activations) and against the
device's peak bytes in use after one update (the log-prob pass included). Models run smallest
first in one process, so each peak is that model's. Then the vLLM sync's export of the last model
(vllm_engine/sync/export.py: bf16, 512 MiB buckets into /dev/shm, both slots warm): GB/s of the written bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import qwen3_0p6b_math
from experiments.benchmarks import common
from rstar2_jax.learner import Learner, LearnerSettings
from rstar2_jax.learner.packing import SEGMENTS_PER_ROW
from rstar2_jax.models import Decoder
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rl.memory_plan import GiB, memory_plan


def run_config(rows: int, seq: int, micro: int = 1, *, remat: str = "full", token_budget: int = 0,
               attention: str = "cudnn", segments_per_row: int = SEGMENTS_PER_ROW) -> RunConfig:
    data = os.path.join(tempfile.mkdtemp(), "problems.jsonl")
    with open(data, "w") as f:
        f.write('{"problem": "1+1", "answer": "2"}\n')
    c = qwen3_0p6b_math.get_config(f",{data}")
    c.data.problems.eval_path = data
    c.rl.batch_problems, c.rl.group_size, c.rl.micro_batches = rows // 2, 2, micro
    c.rl.oversample = 1
    c.rl.token_budget = token_budget
    c.logging.backends = ()  # only the plan is wanted: no tracker's package needed (a device image lacks them)
    c.model.remat = remat
    c.model.attention = attention
    c.rl.segments_per_row = segments_per_row
    c.rollout.max_len = seq
    c.stages = [{**stage, "max_response_tokens": seq // 2} for stage in c.stages]
    cfg, problems = RunConfig.parse(c.to_dict())
    if problems:
        raise SystemExit(f"config problems: {problems}")
    return cfg


def measure(name: str, rows: int, seq: int, micro: int = 1):
    cfg = run_config(rows, seq, micro)
    arch = common.shape(name)
    plan = memory_plan(arch, cfg, devices=1, devices_per_process=1, capacity=None)
    lines = {line.name: line.bytes for line in plan.lines}
    model = Decoder(arch, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), remat=cfg.model.remat)
    model.set_attention(full=cfg.model.attention)
    learner = Learner(model, LearnerSettings(micro_batches=micro), own_params=True)  # no copy
    del model
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, arch.vocab_size, (rows, seq)).astype(np.int32),
             "loss_mask": np.ones((rows, seq), np.float32), "advantages": np.ones((rows,), np.float32),
             "old_logprobs": np.zeros((rows, seq), np.float32)}
    on_device = {k: jnp.asarray(v) for k, v in batch.items()}
    analysis = learner._train.lower(learner.state, on_device).compile().memory_analysis()
    learner.state, _ = learner._train(learner.state, on_device)
    jax.block_until_ready(learner.state)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    state_plan = lines["parameters"] + lines["optimizer"]
    work_plan = lines["gradients"] + lines["activations"]
    args_xla = analysis.argument_size_in_bytes - sum(v.nbytes for v in batch.values())
    row = [f"{name} {rows}x{seq}, {micro} micro-batch(es)", f"{state_plan / GiB:.2f} / {args_xla / GiB:.2f}",
           f"{work_plan / GiB:.2f} / "
           f"{analysis.temp_size_in_bytes / GiB:.2f}", f"{(state_plan + work_plan) / GiB:.2f} / {peak / GiB:.2f}",
           f"{(state_plan + work_plan) / peak:.2f}"]
    print(" | ".join(row), flush=True)
    params = learner.model_state()
    return row, params, arch


def export_rate(params, arch, bucket_mb: int = 512, repeats: int = 3) -> tuple[float, float]:
    model = Decoder(arch, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model, nnx.Param)
    model = nnx.merge(graphdef, params)
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    nbytes, rate, _ = common.weight_export_rate(model, jnp.bfloat16, bucket_mb << 20, root, repeats)
    return nbytes / 1e9, rate


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_0p6b,qwen3_1p7b")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--variants", default="", help="[model:]rows:micro_batches,... (model: the first of --models; "
                   "then the other models at --rows, one micro-batch); smallest first: the peak is the process's")
    p.add_argument("--no_export", action="store_true")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    common.enable_compile_cache()
    print(common.device_line(), flush=True)
    rows, params, arch = [], None, None
    names = args.models.split(",")
    runs = [(v[0], int(v[1]), int(v[2])) if len(v) == 3 else (names[0], int(v[0]), int(v[1]))
            for v in (x.split(":") for x in args.variants.split(",") if x)]
    runs += [(name, args.rows, 1) for name in (names[1:] if runs else names)]
    for name, n_rows, micro in runs:
        row, params, arch = measure(name, n_rows, args.seq, micro)
        rows.append(row)
        gc.collect()
    if args.no_export:
        return
    gb, rate = export_rate(params, arch)
    print(f"export of {args.models.split(',')[-1]}: {gb:.2f} GB bf16 at {rate:.2f} GB/s", flush=True)
    table = common.markdown_table(["model", "state GiB plan / XLA arguments", "gradients + activations GiB plan / "
                                   "XLA temporaries", "total GiB plan / peak in use", "plan / peak"], rows)
    common.record(args.record, "Memory plan against JAX on one GPU",
                  common.command_line("experiments.benchmarks.memory_plan_gpu", argv),
                  f"bf16 compute, remat full, cuDNN attention, {args.rows} x {args.seq} tokens in one micro-batch; "
                  f"then the sync export of the last model: {gb:.2f} GB bf16 at {rate:.2f} GB/s (512 MiB buckets, "
                  "/dev/shm, both slots warm)", table, group=common.MEMORY_PLAN)


if __name__ == "__main__":
    main()
