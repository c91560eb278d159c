"""Trackers (issue 39): the same records reach TensorBoard, W&B (offline run files) and MLflow (a
file store, read through its own client), each read back; a restarted run continues the same
tracker run; a tracker that cannot start is reported once and the others go on; a tracker that
is not installed is refused by the config check."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys

import pytest

from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.trackers import TRACKERS, LoggingConfig, TrackerSet, TrackerSpec
from rstar2_jax.trackers.mlflow_tracker import mlflow_name, tracking_uri
from tests.rl.test_training import tensorboard_tags
from tests.tracker_files import mlflow_metrics, wandb_history, wandb_run_ids

RL = [{"accuracy": 0.25, "eval/pass@1": 0.5, "mismatch/k1_token": 1e-3}, {"accuracy": 0.75, "eval/pass@1": 0.25,
                                                                          "mismatch/k1_token": 2e-3}]
SFT = [{"sft/loss": 2.0}, {"sft/loss": 1.5}, {"sft/loss": 1.25}]


def log_run(workdir, backends, sft=SFT, rl=RL, first_step=0):
    settings = LoggingConfig(backends=backends, wandb_mode="offline")
    trackers = TrackerSet(str(workdir), settings, run_name="t", config={"rl": {"steps": 2}})
    for i, m in enumerate(sft):
        trackers.log(m, i, axis="sft")
    for i, m in enumerate(rl):
        trackers.log(m, first_step + i, axis="rl")
    trackers.text("results", "a table", len(rl))
    trackers.close()
    return trackers


def test_the_same_names_and_values_reach_tensorboard_wandb_and_mlflow(tmp_path):
    trackers = log_run(tmp_path, ("tensorboard", "wandb", "mlflow"))
    assert trackers.failed == {}
    names = {k for m in SFT + RL for k in m}
    assert {mlflow_name(n) for n in names} <= tensorboard_tags(tmp_path / "tensorboard")  # pass@1 -> pass_1
    history = wandb_history(tmp_path)  # SFT steps on sft/step, RL steps on rl_step: both from 0
    assert [(r["sft/step"], r["sft/loss"]) for r in history if "sft/loss" in r] == [(i, m["sft/loss"])
                                                                                      for i, m in enumerate(SFT)]
    assert [(r["rl_step"], r["accuracy"], r["eval/pass@1"]) for r in history if "accuracy" in r] == \
        [(i, m["accuracy"], m["eval/pass@1"]) for i, m in enumerate(RL)]
    ids = json.loads((tmp_path / "trackers.json").read_text())
    metrics = mlflow_metrics(tracking_uri("", str(tmp_path)), ids["mlflow"])
    assert set(metrics) == {mlflow_name(n) for n in names}
    assert metrics["eval/pass_1"] == [(i, m["eval/pass@1"]) for i, m in enumerate(RL)]
    assert metrics["sft/loss"] == [(i, m["sft/loss"]) for i, m in enumerate(SFT)]
    assert wandb_run_ids(tmp_path) == {ids["wandb"]}


def test_a_restarted_run_continues_the_same_tracker_runs(tmp_path):
    log_run(tmp_path, ("wandb", "mlflow"), rl=RL[:1])
    ids = json.loads((tmp_path / "trackers.json").read_text())
    log_run(tmp_path, ("wandb", "mlflow"), sft=[], rl=RL[1:], first_step=1)  # resumed from step 1
    assert json.loads((tmp_path / "trackers.json").read_text()) == ids
    assert wandb_run_ids(tmp_path) == {ids["wandb"]}  # one W&B run, in two offline segments
    assert [r["accuracy"] for r in wandb_history(tmp_path) if "accuracy" in r] == [0.25, 0.75]
    assert mlflow_metrics(tracking_uri("", str(tmp_path)), ids["mlflow"])["accuracy"] == [(0, 0.25), (1, 0.75)]


@contextlib.contextmanager
def registered(name, open_fn):
    """A tracker registered for the length of one test."""
    TRACKERS[name] = TrackerSpec(open_fn, None, None)
    try:
        yield
    finally:
        del TRACKERS[name]


def test_a_tracker_that_cannot_start_is_reported_once_and_the_others_go_on(tmp_path, caplog):
    def broken(context):
        raise ConnectionError("no route to the tracking server")
    with registered("broken_tracker", broken), caplog.at_level(logging.WARNING):
        trackers = log_run(tmp_path, ("broken_tracker", "tensorboard"))
    assert "broken_tracker" in trackers.failed and "no route" in trackers.failed["broken_tracker"]
    assert sum("broken_tracker could not start" in r.getMessage() for r in caplog.records) == 1
    assert "accuracy" in tensorboard_tags(tmp_path / "tensorboard")


def test_a_tracker_that_fails_mid_run_is_dropped_once(tmp_path, caplog):
    class Flaky:
        def __init__(self, context):
            self.calls = 0

        def log(self, metrics, step, axis):
            self.calls += 1
            if self.calls == 2:
                raise OSError("disk full")

        def text(self, name, text, step):
            pass

        def close(self):
            pass
    with registered("flaky_tracker", Flaky), caplog.at_level(logging.WARNING):
        trackers = log_run(tmp_path, ("flaky_tracker", "mlflow"))
    assert "disk full" in trackers.failed["flaky_tracker"]
    assert sum("flaky_tracker failed to log" in r.getMessage() for r in caplog.records) == 1
    ids = json.loads((tmp_path / "trackers.json").read_text())
    assert len(mlflow_metrics(tracking_uri("", str(tmp_path)), ids["mlflow"])["accuracy"]) == 2


def test_a_tracker_that_is_not_installed_is_refused_naming_the_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigValueError, match=r"backends: wandb is not installed: pip install -e '.\[wandb\]'"):
        LoggingConfig.from_mapping({"backends": ["tensorboard", "wandb"]})
    with pytest.raises(ConfigValueError, match=r"'tensorboard' is listed twice"):
        LoggingConfig.from_mapping({"backends": ["tensorboard", "tensorboard"]})


def test_tensorboard_writes_its_events_without_loading_torch(tmp_path):
    """tensorboardX imports torch when it is installed (3 s per training process here); the
    tracker hides it for that import (trackers/tensorboard.py), and torch still imports after."""
    script = f"""
import sys
from rstar2_jax.trackers import TrackerSet, LoggingConfig
trackers = TrackerSet({str(tmp_path)!r}, LoggingConfig(backends=("tensorboard",)), run_name="t", config={{}})
trackers.log({{"accuracy": 0.5}}, 0, axis="rl")
trackers.close()
assert "torch" not in sys.modules, "tensorboardX loaded torch"
import torch  # hidden for tensorboardX's import only
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert "accuracy" in tensorboard_tags(tmp_path / "tensorboard")
