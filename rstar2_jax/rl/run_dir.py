"""What a run directory says about its run, kept true across restarts.

    config.json            the config the run trains with now (what the notebooks show)
    config_history.jsonl   every change to it after the run began: when, which keys, old -> new, why
    run.json               base model directory, run name, prompt format (what evaluate / chat load)
    results.json           before / after RL evaluations, with the step each was taken at

A restart whose config differs from config.json stops with the differing keys, unless every
difference is one a run may take on while resuming (RESUMABLE_CHANGES: more steps, checkpoint
cadence, where servers and sandbox workers are), or the user said `--config_mismatch=ok`;
either way the change is appended to config_history.jsonl before config.json is rewritten.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rollout.engines.factory import ENGINES  # (the factory: every kind registered)

# Keys a resumed run may change without being told: they extend the run or move where its
# parts run, not what it learns.
RESUMABLE_CHANGES = frozenset({
    "rl.steps", "checkpoint.every", "checkpoint.keep", "eval.before_and_after",
    "sandbox.backend", "sandbox.local.workers", "sandbox.redis.url", "sandbox.http.url",
    # how the learner lays out the same rollouts (packed or padded rows, a budget): the same loss to
    # rounding (tests/learner/test_packing.py), and a run from before auto packing records 0
    "rl.token_budget",
    # each engine's own (EngineKind.resumable): where it runs
    *(f"rollout.{name}.{key}" for name, kind in ENGINES.items() for key in kind.resumable),
})
MISMATCH_CHOICES = ("stop", "ok")


class ConfigMismatchError(ValueError):
    """A restart with a config other than the one the run directory was trained with."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf}; lists (stages, URLs) stay whole leaves."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (old, new) for every leaf that differs (a key only one side has counts)."""
    a, b = flatten(_json_roundtrip(old)), flatten(_json_roundtrip(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def refused_changes(changes: dict[str, Any]) -> list[str]:
    """The changed keys a resumed run may not take on without --config_mismatch=ok."""
    return sorted(set(changes) - RESUMABLE_CHANGES)


def _json_roundtrip(tree):
    return json.loads(json.dumps(tree))  # tuples and lists compare equal, as on disk


def with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """An older config.json as this version writes it: moved settings in their new places
    (Section.upgraded) and the fields added since at their defaults (so neither is a change)."""
    raw = RunConfig.upgraded(raw)
    parsed, _ = RunConfig.parse(raw)
    return parsed.to_dict() if parsed is not None else raw


class RunDirectory:
    def __init__(self, path: str, create: bool = True):
        self.path = os.path.abspath(path)
        if create:
            os.makedirs(self.path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---- config ---------------------------------------------------------------------------------
    def check_config(self, config: dict[str, Any], mismatch: str = "stop") -> dict[str, tuple[Any, Any]]:
        """How `config` differs from the run's config.json ({} for a new run); ConfigMismatchError
        naming the keys when a difference is not in RESUMABLE_CHANGES and `mismatch` is "stop".
        Reads only: every process of a job can call it before anything starts."""
        if mismatch not in MISMATCH_CHOICES:
            raise ValueError(f"config_mismatch must be one of {MISMATCH_CHOICES}, got {mismatch!r}")
        changes = self.changes(config)
        refused = refused_changes(changes)
        if refused and mismatch != "ok":
            lines = "\n".join(f"  {k}: {changes[k][0]!r} (config.json) -> {changes[k][1]!r} (now)" for k in refused)
            raise ConfigMismatchError(
                f"{self.path} was trained with another config; {len(refused)} setting(s) differ:\n{lines}\n"
                "Resume with the run's own config, start a new --workdir, or pass --config_mismatch=ok to "
                f"change it (recorded in {self.file('config_history.jsonl')}).")
        return changes

    def changes(self, config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """key -> (config.json's value, `config`'s) for each setting that differs ({} for a new run)."""
        if not os.path.exists(self.file("config.json")):
            return {}
        with open(self.file("config.json")) as f:
            return config_changes(with_defaults(json.load(f)), config)

    def record_config(self, config: dict[str, Any], mismatch: str = "stop") -> dict[str, tuple[Any, Any]]:
        """Write `config` as the run's config.json, after check_config; a change is appended to
        config_history.jsonl first. Returns the changes."""
        changes = self.check_config(config, mismatch)
        if changes:
            accepted = "config_mismatch=ok" if refused_changes(changes) else "resumable"
            with open(self.file("config_history.jsonl"), "a") as f:
                f.write(json.dumps({"time": time.time(), "changes": {k: list(v) for k, v in changes.items()},
                                    "accepted": accepted}) + "\n")
        self._write_json("config.json", config)
        return changes

    def config_history(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.file("config_history.jsonl")):
            return []
        with open(self.file("config_history.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]

    # ---- run info and results -------------------------------------------------------------------
    def write_run_info(self, info: dict[str, Any]):
        self._write_json("run.json", info)

    def load_results(self) -> dict[str, Any]:
        if not os.path.exists(self.file("results.json")):
            return {}
        with open(self.file("results.json")) as f:
            return json.load(f)

    def save_results(self, results: dict[str, Any]):
        self._write_json("results.json", results)

    def _write_json(self, name: str, value):
        tmp = self.file(name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, self.file(name))  # a crash mid-write leaves the old file
