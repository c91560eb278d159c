"""TensorBoard event files in WORKDIR/tensorboard (tensorboardX)."""

from __future__ import annotations

import os

from rstar2_jax.trackers.base import LoggingContext, register_tracker


class TensorBoard:
    def __init__(self, context: LoggingContext):
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(os.path.join(context.workdir, "tensorboard"))

    def log(self, metrics, step, axis):
        del axis  # SFT metrics carry their sft/ prefix; each tag has its own step series
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def text(self, name, text, step):
        self.writer.add_text(name, text, step)

    def close(self):
        self.writer.close()


register_tracker("tensorboard", package="tensorboardX")(TensorBoard)
