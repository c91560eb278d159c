"""SCALING.md's "what fits where" table, made by the memory plan itself (what `train --plan` prints).

    python -m experiments.benchmarks.scaling_table          # the table, as SCALING.md holds it

Each row is a recipe on a public shape (models/shapes.py: no weights are read), planned as
`train --plan --plan_model=SHAPE --num_processes=N` plans it on an H100 (76 GiB usable:
sharding.DEVICE_MEMORY_GIB). tests/test_scaling_table.py checks SCALING.md against this output,
so the document's figures are the plan's (issue 80: they had drifted from it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from experiments import qwen3_0p6b_math, rstar2_agent_14b
from rstar2_jax.models.shapes import plan_architecture
from rstar2_jax.rl.config import validate
from rstar2_jax.rl.memory_plan import GiB, plan_for_launch, resolve_token_budget


@dataclasses.dataclass(frozen=True)
class Row:
    model: str          # the shape planned for
    recipe: str         # what the table says of the recipe
    module: object      # the experiment file
    processes: int      # trainer processes (a host's 8 GPUs each for the 14B recipe)
    overrides: tuple = ()  # (dotted key, value)


ROWS = (
    Row("qwen3_0p6b", "`qwen3_0p6b_math`", qwen3_0p6b_math, 1),
    Row("qwen3_1p7b", "`qwen3_0p6b_math` on the 1.7B shape", qwen3_0p6b_math, 1),
    Row("qwen3_14b", "`rstar2_agent_14b`", rstar2_agent_14b, 8),
    Row("qwen3_14b", "`rstar2_agent_14b`, `mesh.fsdp=4`, `rollout.jax.kv_memory_gb=80`", rstar2_agent_14b, 2,
        (("mesh.fsdp", 4), ("rollout.jax.kv_memory_gb", 80.0))),
)
HEADER = ("| model | recipe | GPUs (H100) | learner mesh | rows per micro-batch | per device (GiB of 76) | "
          "largest line |\n|---|---|---|---|---|---|---|")


def plan_row(row: Row, workdir: str):
    """(the run config planned, its MemoryPlan) for one row."""
    arch = plan_architecture(row.model)
    model_dir = os.path.join(workdir, row.model)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(arch.to_hf_dict(), f)
    data = os.path.join(workdir, "problems.jsonl")
    with open(data, "w") as f:
        f.write('{"problem": "1+1", "answer": "2"}\n')
    c = row.module.get_config(f"{model_dir},{data}")
    c.data.problems.eval_path = data
    c.mesh.device_kind = "h100"
    for key, value in row.overrides:
        *path, name = key.split(".")
        node = c
        for part in path:
            node = node[part]
        setattr(node, name, value)
    cfg = resolve_token_budget(validate(c, processes_count=row.processes), row.processes)
    return cfg, plan_for_launch(cfg, row.processes)


def table() -> str:
    lines = [HEADER]
    with tempfile.TemporaryDirectory() as workdir:
        for row in ROWS:
            cfg, plan = plan_row(row, workdir)
            gpus = row.processes * (cfg.mesh.devices_per_process or 1)
            rows = (f"1 packed row of {cfg.rl.token_budget:,} tokens" if cfg.rl.token_budget > 0
                    else f"padded, {cfg.rl.micro_batches} micro-batches")
            largest = max(plan.lines, key=lambda line: line.bytes)
            mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
            lines.append(f"| {row.model} | {row.recipe} | {gpus} | {mesh} | {rows} | {plan.total / GiB:.1f} | "
                         f"{largest.name} {largest.bytes / GiB:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
