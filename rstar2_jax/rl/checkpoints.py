"""Orbax checkpoints of the whole run: train state (params, optimizer, step) and loop metadata
(RL step, stage, data position, weights version). The last `keep` are kept; a killed run resumes
from the newest complete one (orbax writes to a temporary directory and renames when done)."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]):
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self):
        self.manager.close()
