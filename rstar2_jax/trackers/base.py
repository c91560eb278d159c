"""The tracker seam: what a tracker is given (LoggingContext), what it provides (Tracker), and
the registry the shipped trackers (one module each) and a new one register in.

    @register_tracker("mine", package="mine_sdk", extra="mine")
    def open_mine(context: LoggingContext) -> Tracker: ...

Its module is then imported in `trackers/__init__.py` (one line) and `logging.backends` takes
its name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any, Callable, Protocol

from rstar2_jax.core.registry import Registry


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int, axis: str) -> None: ...
    def text(self, name: str, text: str, step: int) -> None: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoggingContext:
    """What a tracker may need to start: where the run lives, its name and config, the settings,
    and the ids trackers saved for this run (to resume the same run after a restart)."""
    workdir: str
    run_name: str
    config: dict[str, Any]
    settings: Any                      # the run's LoggingConfig (trackers/__init__.py)
    saved_ids: dict[str, str]

    def save_id(self, tracker: str, run_id: str):
        self.saved_ids[tracker] = run_id
        write_ids(self.workdir, self.saved_ids)


@dataclasses.dataclass(frozen=True)
class TrackerSpec:
    open: Callable[[LoggingContext], Tracker]
    package: str | None  # the module that must be importable (None: always available)
    extra: str | None    # the pyproject extra that installs it


TRACKERS: Registry[TrackerSpec] = Registry("tracker")


def register_tracker(name: str, package: str | None = None, extra: str | None = None):
    def wrap(open_fn):
        TRACKERS.register(name, TrackerSpec(open_fn, package, extra))
        return open_fn
    return wrap


def installed(name: str) -> bool:
    spec = TRACKERS[name]
    return spec.package is None or importlib.util.find_spec(spec.package) is not None


IDS_FILE = "trackers.json"  # WORKDIR/trackers.json: {tracker: its run id}, so that a restart resumes it


def read_ids(workdir: str) -> dict[str, str]:
    try:
        with open(os.path.join(workdir, IDS_FILE)) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def write_ids(workdir: str, ids: dict[str, str]):
    tmp = os.path.join(workdir, IDS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ids, f)
    os.replace(tmp, os.path.join(workdir, IDS_FILE))
