"""MLflow (the `mlflow` extra: mlflow-skinny, with SQLAlchemy for a database store): one MLflow run
per run directory in the experiment `logging.project`, resumed after a restart (its id is kept
in WORKDIR/trackers.json), the config as the run's config.json artifact.

The tracking URI: `logging.mlflow_tracking_uri`, else MLFLOW_TRACKING_URI, else an SQLite store
WORKDIR/mlflow.db (MLflow 3 keeps its file store in maintenance mode and refuses it by default).
Metric names are TensorBoard's: a character other than a letter, digit or _ - . / becomes "_"
(pass@1 is pass_1 in both; MLflow itself refuses "@").
"""

from __future__ import annotations

import os
import pathlib
import re
import time

from rstar2_jax.trackers.base import LoggingContext, register_tracker

BATCH = 1000  # MLflow's most metrics per log_batch


def mlflow_name(name: str) -> str:
    """The name TensorBoard gives a tag (tensorboardX's _clean_tag), which MLflow also accepts."""
    return re.sub(r"[^-/\w.]", "_", name).lstrip("/")


def tracking_uri(setting: str, workdir: str) -> str:
    return setting or os.environ.get("MLFLOW_TRACKING_URI") or \
        "sqlite:///" + os.path.join(os.path.abspath(workdir), "mlflow.db")


class MLflow:
    def __init__(self, context: LoggingContext):
        from mlflow.tracking import MlflowClient
        uri = tracking_uri(context.settings.mlflow_tracking_uri, context.workdir)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(context.settings.project)
        # a local store's artifacts go beside it (MLflow's default is ./mlruns under the cwd)
        artifacts = pathlib.Path(os.path.abspath(context.workdir), "mlflow-artifacts").as_uri() \
            if uri.startswith("sqlite:") else None
        experiment_id = experiment.experiment_id if experiment else \
            self.client.create_experiment(context.settings.project, artifact_location=artifacts)
        run_id = context.saved_ids.get("mlflow")
        if run_id is None:
            run_id = self.client.create_run(experiment_id, run_name=context.run_name or None).info.run_id
            context.save_id("mlflow", run_id)
            self.client.log_dict(run_id, context.config, "config.json")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, metrics, step, axis):
        from mlflow.entities import Metric
        del axis  # the sft/ prefix keeps SFT steps apart
        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + BATCH])

    def text(self, name, text, step):
        self.client.log_text(self.run_id, text, f"{mlflow_name(name)}_{step}.txt")

    def close(self):
        self.client.set_terminated(self.run_id)


register_tracker("mlflow", package="mlflow", extra="mlflow")(MLflow)
