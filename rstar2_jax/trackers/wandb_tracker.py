"""Weights & Biases (the `wandb` extra): one W&B run per run directory, resumed after a restart
(its id is kept in WORKDIR/trackers.json), files under WORKDIR/wandb.

RL metrics and evaluations are plotted against `rl_step`, SFT metrics against `sft/step`
(define_metric): the two phases count steps from 0 each, and W&B's own step must only grow.
`logging.wandb_mode=offline` writes the run to disk for a later `wandb sync`.
"""

from __future__ import annotations

import secrets

from rstar2_jax.trackers.base import LoggingContext, register_tracker

AXES = {"rl": "rl_step", "sft": "sft/step"}


class WandB:
    def __init__(self, context: LoggingContext):
        import wandb
        s = context.settings
        run_id = context.saved_ids.get("wandb") or secrets.token_hex(4)  # W&B ids: [a-z0-9]
        self.run = wandb.init(project=s.project, entity=s.wandb_entity or None, name=context.run_name, id=run_id,
                              resume="allow", dir=context.workdir, config=context.config, mode=s.wandb_mode or None,
                              settings=wandb.Settings(console="off"))  # our console lines stay ours
        context.save_id("wandb", run_id)
        self.defined: set[str] = set()

    def log(self, metrics, step, axis):
        axis_key = AXES[axis]
        if axis_key not in self.defined:
            self.run.define_metric(axis_key)
            self.defined.add(axis_key)
        for k in metrics:
            if k not in self.defined:
                self.run.define_metric(k, step_metric=axis_key)
                self.defined.add(k)
        self.run.log({**metrics, axis_key: step})

    def text(self, name, text, step):
        del step
        self.run.summary[name] = text

    def close(self):
        self.run.finish()


register_tracker("wandb", package="wandb", extra="wandb")(WandB)
