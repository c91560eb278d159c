"""`data.task=arith`: the CPU demo's synthetic multi-digit arithmetic (data/arith.py), with SFT traces."""

from __future__ import annotations

from rstar2_jax.data.tasks.base import Task, register_task


def _check_arith(data_cfg):
    for field in ("train_problems", "eval_problems"):
        if getattr(data_cfg, field) <= 0:
            yield field, "must be > 0 for the arith task (it makes that many problems)"


@register_task("arith", has_sft_data=True, check=_check_arith)
def arith_task(data_cfg, seed: int) -> Task:
    from rstar2_jax.data import arith  # the demo task's code loads only when a run uses it
    return Task("arith", arith.make_problems(data_cfg.train_problems, seed=seed + 1),
                arith.make_problems(data_cfg.eval_problems, seed=10_000 + seed), sft_data=arith.sft_dataset)
