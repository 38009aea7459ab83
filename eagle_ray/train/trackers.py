"""Experiment trackers for the training metrics (`train.loggers`), written from rank 0 only.

`tensorboard`: event files in `<output_dir>/tensorboard`. `mlflow`: a run in
`train.mlflow_tracking_uri` (a tracking server, a database, or by default the local folder
`<output_dir>/mlruns`), named after `run_name`, with the job config as parameters. Both are
optional extras (`pip install eagle_ray[trackers]`); asking for one that is not installed is a
configuration error before training starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from eagle_ray.config import ConfigError, flatten

LOGGERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # name -> module it needs


def check_loggers(names: list[str]) -> None:
    """Unknown or uninstalled trackers stop the job before anything starts."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"train.loggers: unknown logger {name!r}; choose from "
                              f"{sorted(LOGGERS)}")
        if importlib.util.find_spec(LOGGERS[name]) is None:
            raise ConfigError(f"train.loggers: {name!r} needs the {LOGGERS[name]!r} package; "
                              f"pip install 'eagle_ray[trackers]'")


class Trackers:
    """The configured trackers behind one `log(metrics, step)`."""

    def __init__(self, names: list[str], output_dir: Path, run_name: str,
                 config: dict[str, Any], mlflow_tracking_uri: str | None,
                 mlflow_experiment: str) -> None:
        self.writer = self.mlflow = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")
        if "mlflow" in names:
            import mlflow

            if mlflow_tracking_uri is None:
                # A local folder: MLflow keeps its file store for this use, behind an opt-in.
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow_tracking_uri = (output_dir / "mlruns").as_uri()
            mlflow.set_tracking_uri(mlflow_tracking_uri)
            mlflow.set_experiment(mlflow_experiment)
            self.mlflow = mlflow
            mlflow.start_run(run_name=run_name)
            mlflow.log_params({k: str(v)[:500] for k, v in flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if k != "step"}
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.mlflow is not None:
            self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.mlflow is not None:
            self.mlflow.end_run()
