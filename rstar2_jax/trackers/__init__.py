"""Where a run's metrics go besides metrics.jsonl (always written): the trackers in
`logging.backends`, each one module here registered in TRACKERS (the seam: base.py).

Every tracker gets the same records with the same names (README's metric table): RL steps under
their names at their step, SFT steps under sft/ (their own step axis), evaluations under
eval/<label>/ at the RL step they ran at. A tracker is opened by `open(LoggingContext)` and gets
`log(metrics, step, axis)` ("rl" or "sft"), `text(name, text, step)` and `close()`.

A tracker's package missing is a config error (logging.backends, naming the extra to install); a
tracker that fails to start or to log at run time is reported once and dropped, and the run goes
on with the others (TrackerSet).
"""

from __future__ import annotations

import dataclasses
import logging as pylogging
import re

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.trackers.base import (IDS_FILE, TRACKERS, LoggingContext, Tracker, TrackerSpec, installed,
                                      read_ids, register_tracker)

log = pylogging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    backends: tuple[str, ...] = setting(("tensorboard",), "trackers besides metrics.jsonl (always written): "
                                        "tensorboard, wandb, mlflow")
    project: str = setting("rstar2-jax", "the W&B project and the MLflow experiment", nonempty=True)
    wandb_mode: str = setting("", "W&B: online | offline | '' (WANDB_MODE, else online)",
                              choices=("", "online", "offline"))
    wandb_entity: str = setting("", "W&B: the team or user ('' = the logged-in user's default)")
    mlflow_tracking_uri: str = setting("", "MLflow: http(s)://server, sqlite:///abs.db, postgresql://..., "
                                       "databricks; '' = MLFLOW_TRACKING_URI, else sqlite:///WORKDIR/mlflow.db")

    def rules(self):
        seen = set()
        for name in self.backends:
            if name in seen:
                yield "backends", f"{name!r} is listed twice"
            seen.add(name)
            if TRACKERS.problem(name):
                yield "backends", TRACKERS.problem(name)
            elif not installed(name):
                spec = TRACKERS[name]
                install = f"pip install -e '.[{spec.extra}]'" if spec.extra else f"pip install {spec.package}"
                yield "backends", f"{name} is not installed: {install} (or take {name} out of logging.backends)"
        if self.wandb_entity and not re.fullmatch(r"[\w.-]+", self.wandb_entity):
            yield "wandb_entity", f"{self.wandb_entity!r} is not a W&B team or user name (letters, digits, - _ .)"
        uri = self.mlflow_tracking_uri
        if uri and "://" not in uri and uri != "databricks":
            yield "mlflow_tracking_uri", f"{uri!r} is not a tracking URI (http(s)://, sqlite:///abs.db, databricks)"


class TrackerSet:
    """The run's trackers, opened on first use (a re-run with nothing to log opens none). One
    that fails is reported once, with why, and dropped; the others go on."""

    def __init__(self, workdir: str, settings: LoggingConfig, run_name: str = "", config: dict | None = None):
        self.workdir, self.settings = workdir, settings
        self.run_name, self.config = run_name, config or {}
        self._open: dict[str, Tracker] | None = None
        self.failed: dict[str, str] = {}

    def _trackers(self) -> dict[str, Tracker]:
        if self._open is None:
            self._open = {}
            context = LoggingContext(self.workdir, self.run_name, self.config, self.settings, read_ids(self.workdir))
            for name in self.settings.backends:
                try:
                    self._open[name] = TRACKERS[name].open(context)
                except Exception as e:  # noqa: BLE001 - a tracker must not stop the run
                    self._fail(name, "could not start", e)
        return self._open

    def _fail(self, name: str, what: str, e: BaseException):
        self.failed[name] = f"{type(e).__name__}: {e}"
        log.warning("tracker %s %s (%s); the run goes on without it", name, what, self.failed[name])
        if self._open is not None:
            self._open.pop(name, None)

    def _each(self, what: str, call):
        for name, tracker in list(self._trackers().items()):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001
                self._fail(name, f"failed to {what}", e)

    def log(self, metrics: dict[str, float], step: int, axis: str = "rl"):
        if metrics:
            self._each("log", lambda t: t.log(metrics, step, axis))

    def text(self, name: str, text: str, step: int):
        self._each("log text", lambda t: t.text(name, text, step))

    def close(self):
        if self._open is not None:  # none opened: nothing to close (and nothing to open for it)
            self._each("close", lambda t: t.close())
            self._open = None


# the shipped trackers register themselves on import (each imports only trackers/base.py)
from rstar2_jax.trackers import mlflow_tracker, tensorboard, wandb_tracker  # noqa: E402,F401

__all__ = ["IDS_FILE", "TRACKERS", "LoggingConfig", "LoggingContext", "Tracker", "TrackerSet", "TrackerSpec",
           "installed", "register_tracker"]
