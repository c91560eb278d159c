"""`train --stage=I.FIELD=VALUE`: a stage's settings from the command line.

ml_collections cannot override a list field (`--config.stages...` is refused: "Type <class 'list'>
of field config.stages is not supported for overriding"), so each stage's budget, turns and filter
are set through this flag instead, as often as needed:

    --stage=0.max_response_tokens=8000 --stage=1.max_turns=10          # stage 0's budget, stage 1's turns
    --stage=max_turns=6                                                 # every stage's
    --stage=2.start_step=300 --stage=2.max_response_tokens=12000        # a new stage: a copy of the last, from step 300

The stages then go through the same checks as an experiment file's (rl/config.py): every error
of every entry at once, each naming the flag."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.config import StageConfig

FIELDS = {f.name: f for f in dataclasses.fields(StageConfig)}


def _value(field: dataclasses.Field, text: str) -> Any:
    kind = type(field.default)
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{text!r} is not true or false")
        return text.lower() in ("true", "1")
    return kind(text)


def apply_stage_flags(stages: Sequence[dict], specs: Sequence[str]) -> list[dict]:
    """The stages with every --stage entry applied (new stages copy the last one's settings)."""
    out = [dict(s) for s in stages]
    problems = []
    for spec in specs:
        target, sep, text = spec.partition("=")
        index, _, name = target.rpartition(".")
        flag = f"--stage={spec}"
        if not sep or not name:
            problems.append(f"{flag}: expected [INDEX.]FIELD=VALUE, e.g. --stage=0.max_response_tokens=8000")
            continue
        if name not in FIELDS:
            problems.append(f"{flag}: stages have no field {name!r}; they have {', '.join(FIELDS)}")
            continue
        try:
            value = _value(FIELDS[name], text)
        except ValueError as e:
            problems.append(f"{flag}: {e}")
            continue
        if not index:
            for stage in out:
                stage[name] = value
            continue
        if not index.isdigit() or int(index) > len(out):
            problems.append(f"{flag}: there are stages 0-{len(out) - 1}; {index!r} is none of them, nor the next "
                            f"one ({len(out)}, which adds a stage)")
            continue
        i = int(index)
        if i == len(out):  # a new stage: the last one's settings, then what the flags set
            if not out:
                problems.append(f"{flag}: there is no stage to copy")
                continue
            out.append({**out[-1], "start_step": None})
        out[i][name] = value
    for i, stage in enumerate(out):
        if stage.get("start_step") is None:
            problems.append(f"--stage={i}.start_step=N is needed: stage {i} is new (the RL step it begins at)")
    if problems:
        raise ConfigValueError(problems)
    return out
