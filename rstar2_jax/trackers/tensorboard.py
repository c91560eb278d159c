"""TensorBoard event files in WORKDIR/tensorboard (tensorboardX)."""

from __future__ import annotations

import os
import sys

from rstar2_jax.trackers.base import LoggingContext, register_tracker


class TensorBoard:
    def __init__(self, context: LoggingContext):
        self.writer = _summary_writer()(os.path.join(context.workdir, "tensorboard"))

    def log(self, metrics, step, axis):
        del axis  # SFT metrics carry their sft/ prefix; each tag has its own step series
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def text(self, name, text, step):
        self.writer.add_text(name, text, step)

    def close(self):
        self.writer.close()


def _summary_writer():
    """tensorboardX's SummaryWriter class, imported without torch. tensorboardX imports torch
    whenever it is installed (tensorboardX/writer.py: `numpy_compatible = torch.Tensor`), only to
    accept torch tensors, which our float scalars never are; torch's import was 3.1 s of a 24 s
    tiny training run here. A None entry in sys.modules makes that `import torch` fail, and
    tensorboardX falls back to numpy (it imports torch again only to convert a torch tensor).
    Where torch is already loaded, nothing is saved and nothing is hidden."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


register_tracker("tensorboard", package="tensorboardX")(TensorBoard)
