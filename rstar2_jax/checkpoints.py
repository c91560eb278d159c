"""Orbax checkpoints of the whole run: train state (params, optimizer, step), loop metadata
(the run state as JSON: RL step, stage, data position, weights version) and, for runs with a KL
term, the frozen reference weights. The last `keep` are kept; a killed run resumes from the
newest complete one (orbax writes to a temporary directory and renames when done)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from rstar2_jax.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """`checkpoint.*`: when the run saves its whole state (and the last step always)."""
    every: int = setting(4, "RL steps between checkpoints", min=1)
    keep: int = setting(2, "newest checkpoints kept on disk", min=1)


class RunCheckpoints:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any], reference: Any = None):
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if reference is not None:  # the KL term's frozen reference: saved with the run, never recomputed
            items["reference"] = ocp.args.StandardSave(reference)
        self.manager.save(step, args=ocp.args.Composite(**items))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_reference(self, step: int, like: Any) -> Any:
        """The reference weights saved at `step` (shaped and placed like `like`); a
        checkpoint saved without a KL term has none: ValueError saying so."""
        if "reference" not in self.manager.item_metadata(step):
            raise ValueError(f"checkpoint {self.directory} step {step} holds no reference weights (saved by a run "
                             "without rl.kl.coef); resume with rl.kl.coef=0 or start a new run directory")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(reference=ocp.args.StandardRestore(abstract)))
        return out["reference"]

    def close(self):
        self.manager.close()


class NotARunError(ValueError):
    """A directory that is not a training run (or has no checkpoint yet)."""


def run_info(run_dir: str) -> dict[str, Any]:
    """A training run's run.json: its base model directory, name and prompt format."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        raise NotARunError(f"{run_dir} is not a training run directory (no run.json)")
    with open(path) as f:
        return json.load(f)


def load_run_policy(run_dir: str):
    """The policy of a training run's latest checkpoint (an nnx.Module of its architecture)."""
    from rstar2_jax import models
    from rstar2_jax.learner import Learner

    ckpts = RunCheckpoints(os.path.join(run_dir, "checkpoints"))
    try:
        step = ckpts.latest_step()
        if step is None:
            raise NotARunError(f"no checkpoint under {run_dir}/checkpoints")
        template = Learner(models.load_pretrained(run_info(run_dir)["model_dir"]))
        template.state, _ = ckpts.restore(step, template.state)
    finally:
        ckpts.close()
    return template.model()
