"""Orbax checkpoints of the whole run: train state (params, optimizer, step), loop metadata
(the run state as JSON: RL step, stage, data position, weights version) and, for runs with a KL
term, the frozen reference weights. The last `keep` are kept; a killed run resumes from the
newest complete one (orbax writes to a temporary directory and renames when done).

A LoRA run's train state holds only the adapters and their optimizer moments: its checkpoints
are adapter-only, and record which base they adapt (`base`, adapter_files.base_identity); a
resume on another base is refused (BaseMismatch) before anything starts."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """`checkpoint.*`: when the run saves its whole state (and the last step always)."""
    every: int = setting(4, "RL steps between checkpoints", min=1)
    keep: int = setting(2, "newest checkpoints kept on disk", min=1)


class BaseMismatch(ValueError):
    """An adapter checkpoint resumed on a base model other than the one it was trained on."""


class RunCheckpoints:
    def __init__(self, directory: str, keep: int = 3, base: dict[str, str] | None = None):
        """base: the identity of the frozen base (LoRA runs; None: the state is the whole model)."""
        self.directory = os.path.abspath(directory)
        self.base = base
        # Every item's handler named up front: without them a manager that has not saved (a resume,
        # chat) logs "Item ... was found in the checkpoint, but could not be restored" for each item
        # whenever it reads a checkpoint's metadata.
        handlers = dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler(),
                        reference=ocp.StandardCheckpointHandler(), base=ocp.JsonCheckpointHandler())
        self.manager = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                             options=ocp.CheckpointManagerOptions(
                                                 max_to_keep=keep, create=True, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any], reference: Any = None):
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if reference is not None:  # the KL term's frozen reference: saved with the run, never recomputed
            items["reference"] = ocp.args.StandardSave(reference)
        if self.base is not None:
            items["base"] = ocp.args.JsonSave(self.base)
        self.manager.save(step, args=ocp.args.Composite(**items))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        self.check_base(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def check_base(self, step: int):
        """BaseMismatch when the checkpoint at `step` adapts another base than this run's, or is
        (or is not) an adapter checkpoint where this run is the other kind."""
        saved = (dict(self.manager.restore(step, args=ocp.args.Composite(base=ocp.args.JsonRestore())))["base"]
                 if "base" in self.manager.item_metadata(step) else None)
        where = f"checkpoint {self.directory} step {step}"
        if saved is None and self.base is not None:
            raise BaseMismatch(f"{where} holds a whole model (trained without model.lora): resume with "
                               "model.lora.rank=0, or start a new run directory")
        if saved is not None and self.base is None:
            raise BaseMismatch(f"{where} holds LoRA adapters: resume with the run's model.lora settings")
        if saved is not None and saved != self.base:
            differ = sorted(k for k in set(saved) | set(self.base) if saved.get(k) != self.base.get(k))
            raise BaseMismatch(f"{where} holds adapters of another base model ({', '.join(differ)} differ): set "
                               "model.path to the base the run was trained on, or start a new run directory")

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


def load_run_policy(run_dir: str, step: int | None = None):
    """The policy of a training run's checkpoint at `step` (None: the latest; 0: after SFT, before
    RL), an nnx.Module of its architecture."""
    from rstar2_jax import models
    from rstar2_jax.learner import Learner
    from rstar2_jax.models import lora
    from rstar2_jax.models.adapter_files import base_identity

    ckpts = RunCheckpoints(os.path.join(run_dir, "checkpoints"))
    try:
        step = ckpts.latest_step() if step is None else step
        if step is None:
            raise NotARunError(f"no checkpoint under {run_dir}/checkpoints")
        model_dir = run_info(run_dir)["model_dir"]
        adapters = _run_adapters(run_dir)
        template = Learner(lora.attach(models.load_pretrained(model_dir), adapters, seed=0))
        if adapters.enabled:
            ckpts.base = base_identity(model_dir)
        template.state, _ = ckpts.restore(step, template.state)
    finally:
        ckpts.close()
    return template.model()


def _run_adapters(run_dir: str):
    """The LoRAConfig a run trained with (its config.json's model.lora; rank 0 when it had none)."""
    from rstar2_jax.models.lora import LoRAConfig
    with open(os.path.join(run_dir, "config.json")) as f:
        section = json.load(f).get("model", {}).get("lora")
    if not section:
        return LoRAConfig()
    cfg, problems = LoRAConfig.parse(section)
    if problems:
        raise ValueError(f"{run_dir}/config.json model.lora: " + "; ".join(map(str, problems)))
    return cfg
