"""In-flight rollouts on disk, turn by turn, so a killed run resumes them where they were.

    journal = StepJournal(root, step, max_version=restored_version)
    traj = await run_agent(..., journal=journal.rollout(index, (question, seed, agent_settings)))

Each rollout of a step writes its trajectory at every turn boundary (after its tool results are
appended: the next thing it does is sample a turn) and once finished, one JSON file per rollout
replaced atomically (write, rename), so a SIGKILL at any instant leaves either the last
boundary or the one before (no fsync: a killed process's writes are in the page cache; after a
machine crash a torn file reads as absent and that rollout starts over). A resumed rollout continues from the saved boundary: the same
tokens, sampler log-probs, per-token versions and tool results; its next turn samples with the
seed it would have had (turn seeds derive from the rollout seed and the turn index), and a
stateful session is rebuilt by running the recorded cells again. With the float32 embedded
engine at rl.max_staleness = 0 the continuation is the uninterrupted run's, bit for bit.

A saved rollout is used only if it is the same rollout (question, seed, agent settings) and if every token
in it was sampled by weights the restored run has (version <= the checkpoint's): tokens of
weights lost with the crash cannot be trained on as if sampled by the restored ones.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil

from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

FORMAT = 1


def trajectory_to_json(traj: Trajectory) -> dict:
    return dataclasses.asdict(traj)


def trajectory_from_json(d: dict) -> Trajectory:
    d = dict(d)
    turns = [Turn(**{**t, "tools": [ToolRecord(**r) for r in t["tools"]]}) for t in d.pop("turns")]
    return Trajectory(**d, turns=turns)


def _digest(identity) -> str:
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:16]


@dataclasses.dataclass
class SavedRollout:
    trajectory: Trajectory
    finished: bool


class RolloutJournal:
    """One rollout's file."""

    def __init__(self, path: str, identity, max_version: int | None, counts: collections.Counter | None = None):
        """identity: what makes it this rollout (question, seed, agent settings); a file saved
        under another identity is not resumed. counts: what loads found ("finished", "partial")."""
        self.path, self.key, self.max_version = path, _digest(identity), max_version
        self.counts = collections.Counter() if counts is None else counts

    def load(self) -> SavedRollout | None:
        """The saved trajectory if it is this rollout's and every token's weights are still there."""
        try:
            with open(self.path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            return None
        if d.get("format") != FORMAT or d.get("key") != self.key:
            return None
        traj = trajectory_from_json(d["trajectory"])
        if self.max_version is not None and max(traj.versions, default=-1) > self.max_version:
            self.counts["newer_weights"] += 1
            return None
        self.counts["finished" if d["finished"] else "partial"] += 1
        return SavedRollout(traj, bool(d["finished"]))

    def save(self, traj: Trajectory, finished: bool):
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "key": self.key, "finished": finished,
                       "trajectory": trajectory_to_json(traj)}, f)
        os.replace(tmp, self.path)


class StepJournal:
    """The in-flight rollouts of one RL step, under ROOT/step<NNNNNN>/, keyed by the rollout's
    index among the step's rollouts (the same in every process: each writes its own share)."""

    def __init__(self, root: str, step: int, max_version: int | None = None):
        self.dir = step_dir(root, step)
        self.max_version = max_version
        self.counts: collections.Counter = collections.Counter()  # rollouts resumed: finished, partial
        os.makedirs(self.dir, exist_ok=True)

    def rollout(self, index: int, identity) -> RolloutJournal:
        return RolloutJournal(os.path.join(self.dir, f"r{index:06d}.json"), identity, self.max_version, self.counts)

    def saved(self) -> int:
        """How many rollouts have a file (finished or not)."""
        return sum(name.endswith(".json") for name in os.listdir(self.dir))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step{step:06d}")


def prune(root: str, before_step: int):
    """Forget the journals of the steps before `before_step` (trained and checkpointed)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith("step") and name[4:].isdigit() and int(name[4:]) < before_step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
