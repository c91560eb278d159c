"""In-flight rollouts on disk, turn by turn, so a killed run resumes them where they were.

    journal = StepJournal(root, step, max_version=restored_version)
    traj = await run_agent(..., journal=journal.rollout(index, question, seed, agent_config))

Each rollout of a step has one JSON-lines file: a header naming the rollout, then one line per
turn boundary (after its tool results are appended: the next thing it does is sample a turn)
holding what the trajectory gained since the previous line (tokens, masks, sampler log-probs,
versions, turns with their tool results), and a last line once it finished. Appending the
difference keeps a save O(new tokens) (rewriting a 16k-token trajectory as JSON at every turn
took 68 ms on the event loop). A SIGKILL mid-write leaves at worst a torn last line, which
reading ignores (no fsync: a killed process's writes are in the page cache; after a machine crash
the rollout resumes from the last whole line, or starts over).

A resumed rollout continues from its last saved boundary: the same tokens, sampler log-probs,
per-token versions and tool results; its next turn samples with the seed it would have had (turn
seeds derive from the rollout seed and the turn index), and a stateful session is rebuilt by
running the recorded cells again. With the float32 embedded engine at rl.max_staleness = 0 the
continuation is the uninterrupted run's, bit for bit.

A saved rollout is used only if it is the same rollout (question, seed, agent settings), and only
up to the last boundary before a token sampled by weights the restored run does not have
(version > the checkpoint's): tokens of weights lost with the crash cannot be trained on as if
sampled by the restored ones. The file is cut back to what was used before new lines go on it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil

from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

FORMAT = 2
_PER_TOKEN = ("token_ids", "loss_mask", "logprobs", "versions", "kv_versions")


def _digest(identity) -> str:
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:16]


def _turn_from_json(t: dict) -> Turn:
    return Turn(**{**t, "tools": [ToolRecord(**r) for r in t["tools"]]})


@dataclasses.dataclass
class SavedRollout:
    trajectory: Trajectory
    finished: bool


class RolloutJournal:
    """One rollout's file (JSON lines: a header, then one line per saved turn boundary)."""

    def __init__(self, path: str, identity, max_version: int | None, counts: collections.Counter | None = None):
        """identity: what makes it this rollout (question, seed, agent settings); a file saved
        under another identity is not resumed. counts: what loads found ("finished", "partial",
        "newer_weights": rollouts cut back to before tokens of lost weights)."""
        self.path, self.key, self.max_version = path, _digest(identity), max_version
        self.counts = collections.Counter() if counts is None else counts
        self._tokens = self._turns = 0   # what the file holds (after load: what was used of it)
        self._keep_bytes: int | None = None  # a used prefix shorter than the file: cut there first

    def load(self) -> SavedRollout | None:
        """The saved trajectory if it is this rollout's, up to its last usable boundary."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except OSError:
            return None
        traj, finished, used, newer = None, False, 0, False
        offset = 0
        for line in raw.splitlines(keepends=True):
            offset += len(line)
            try:
                d = json.loads(line)
            except ValueError:  # a torn last line
                break
            if traj is None:
                if d.get("format") != FORMAT or d.get("key") != self.key:
                    return None
                traj = Trajectory(prompt_len=d["prompt_len"], token_ids=[], loss_mask=[], logprobs=[])
                used = offset
                continue
            if d.get("finished"):
                traj.finish_reason, traj.response_text = d["finish_reason"], d["response_text"]
                traj.graded_text = d.get("graded_text", "")  # older journals: run_agent derives it
                finished, used = True, offset
                break
            if self.max_version is not None and max(d["versions"], default=-1) > self.max_version:
                newer = True
                break
            for name in _PER_TOKEN:
                getattr(traj, name).extend(d[name])
            traj.turns += [_turn_from_json(t) for t in d["turns"]]
            traj.generation_s, traj.tool_s = d["generation_s"], d["tool_s"]
            used = offset
        if traj is None or not traj.token_ids:
            return None
        self.counts["newer_weights"] += newer
        self.counts["finished" if finished else "partial"] += 1
        self._tokens, self._turns = len(traj.token_ids), len(traj.turns)
        self._keep_bytes = used if used < len(raw) else None
        traj.meta["journal_model_tokens"] = sum(traj.loss_mask)  # sampled before: not this run's throughput
        return SavedRollout(traj, finished)

    def save(self, traj: Trajectory, finished: bool):
        """Appends what `traj` gained since the last save (the header first, for a new file)."""
        if self._keep_bytes is not None:  # drop the unused tail of what load read
            with open(self.path, "r+b") as f:
                f.truncate(self._keep_bytes)
            self._keep_bytes = None
        lines = []
        if self._tokens == 0:
            lines.append({"format": FORMAT, "key": self.key, "prompt_len": traj.prompt_len})
        if len(traj.token_ids) > self._tokens or len(traj.turns) > self._turns:
            lines.append({**{name: getattr(traj, name)[self._tokens:] for name in _PER_TOKEN},
                          "turns": [dataclasses.asdict(t) for t in traj.turns[self._turns:]],
                          "generation_s": traj.generation_s, "tool_s": traj.tool_s})
        if finished:
            lines.append({"finished": True, "finish_reason": traj.finish_reason, "response_text": traj.response_text,
                          "graded_text": traj.graded_text})
        with open(self.path, "w" if self._tokens == 0 else "a") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
        self._tokens, self._turns = len(traj.token_ids), len(traj.turns)


class StepJournal:
    """The in-flight rollouts of one RL step, under ROOT/step<NNNNNN>/, keyed by the rollout's
    index among the step's rollouts (the same in every process: each writes its own share)."""

    def __init__(self, root: str, step: int, max_version: int | None = None):
        self.dir = step_dir(root, step)
        self.max_version = max_version
        self.counts: collections.Counter = collections.Counter()  # rollouts resumed: finished, partial
        os.makedirs(self.dir, exist_ok=True)

    def rollout(self, index: int, question: str, seed, agent) -> RolloutJournal:
        """Rollout `index` of the step, which is this rollout only with this question, seed and
        agent settings (repr of the AgentConfig)."""
        return RolloutJournal(os.path.join(self.dir, f"r{index:06d}.jsonl"), (question, seed, repr(agent)),
                              self.max_version, self.counts)

    def resumed_counts(self) -> dict[str, int]:
        """The step's rollouts this process took back from the journal: the step's metrics."""
        return {"inflight/resumed_finished": self.counts["finished"], "inflight/resumed_partial": self.counts["partial"]}


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step{step:06d}")


def prune(root: str, before_step: int):
    """Forget the journals of the steps before `before_step` (trained and checkpointed)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith("step") and name[4:].isdigit() and int(name[4:]) < before_step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
