"""What a run must remember across a restart, typed: the RL step, the weights version, the stage,
the evaluations so far, and the data stream's position and solved set.

It travels in every checkpoint as JSON beside the train state (`RunState.to_json` /
`from_json`). The JSON layout is flat and its key names are those earlier runs wrote, so their
checkpoints still resume; `solved` and `prefiltered_stage` were written only once a filter ran,
`topup_pos` only since dynamic sampling and `carried` only since rl.staleness, so they may be
missing. Any other missing key, an unknown key or a value of the wrong type is a
`RunStateError` that names the checkpoint and the keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class RunStateError(ValueError):
    """A checkpoint's run state this code cannot read."""


@dataclasses.dataclass(frozen=True)
class DataState:
    """The data stream: problems drawn since the run began, problems a filter dropped as solved,
    the stage whose offline pre-filter has run, and the position in the second stream that
    dynamic sampling draws extra problems from."""
    position: int = 0
    solved: tuple[str, ...] = ()
    prefiltered_stage: int | None = None
    topup_position: int = 0


@dataclasses.dataclass(frozen=True)
class CarriedGroups:
    """Groups of a step still running when it trained (rl.staleness.policy=carry): the next step
    trains them. The step's problems by id, and the carried ones by index among them."""
    step: int
    problem_ids: tuple[str, ...]
    groups: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RunState:
    rl_step: int = 0          # RL steps trained
    version: int = 0          # learner updates (the weights version engines hold)
    stage: int = 0            # the stage of the last trained step
    results: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # "before" / "after" evaluations
    data: DataState = DataState()
    carried: CarriedGroups | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rl_step": self.rl_step, "version": self.version, "stage": self.stage, "results": dict(self.results),
                "data_pos": self.data.position, "solved": list(self.data.solved),
                "prefiltered_stage": self.data.prefiltered_stage, "topup_pos": self.data.topup_position,
                "carried": None if self.carried is None else {"step": self.carried.step,
                                                              "problem_ids": list(self.carried.problem_ids),
                                                              "groups": list(self.carried.groups)}}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = "the checkpoint") -> RunState:
        required = {"rl_step": int, "version": int, "stage": int, "results": dict, "data_pos": int}
        optional = {"solved": list, "prefiltered_stage": (int, type(None)), "topup_pos": int,
                    "carried": (dict, type(None))}
        problems = []
        unknown = sorted(set(raw) - set(required) - set(optional))
        if unknown:
            problems.append(f"unknown keys {unknown} (written by a newer version of rstar2-jax?)")
        missing = sorted(set(required) - set(raw))
        if missing:
            problems.append(f"missing keys {missing}")
        for key, tp in {**required, **optional}.items():
            if key in raw and (not isinstance(raw[key], tp) or isinstance(raw[key], bool)):
                problems.append(f"{key} = {raw[key]!r} is not {getattr(tp, '__name__', tp)}")
        if problems:
            raise RunStateError(f"cannot resume from {where}: its run state has " + "; ".join(problems) +
                                f". Keys this version reads: {sorted({**required, **optional})}; start a new run "
                                "directory, or resume with the version that wrote it.")
        carried = raw.get("carried")
        return cls(rl_step=raw["rl_step"], version=raw["version"], stage=raw["stage"], results=dict(raw["results"]),
                   data=DataState(raw["data_pos"], tuple(raw.get("solved", ())), raw.get("prefiltered_stage"),
                                  raw.get("topup_pos", 0)),
                   carried=None if carried is None else CarriedGroups(int(carried["step"]),
                                                                      tuple(carried["problem_ids"]),
                                                                      tuple(carried["groups"])))
