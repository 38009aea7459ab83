"""What a rerun resumes: the settings saved with every training checkpoint, checked first.

Ray Train resumes a run from its latest checkpoint whenever a job reuses the run's name and
storage (`run_name`, `storage_path`). That is what a user wants after an interruption or to train
longer, and a trap when the config changed: a rerun with another seed or `encoding_dtype` would
load the old draft, train nothing new, and report the old draft's results as the new run's. So
each checkpoint carries a `run_record.json` (the settings that shape the draft, and what the
target served), and the driver refuses to resume under other ones, naming each change. Only
those settings are written: paths, resources, `runtime_env` (which may hold credentials) and
tracker addresses stay out of the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, NamedTuple

from eagle_ray.config import ConfigError, JobConfig, flatten, to_dict
from eagle_ray.contract.identity import TargetIdentity

logger = logging.getLogger(__name__)

RECORD_FILE = "run_record.json"

# Keys a resumed run may change: where and on what it runs, how long, what it logs, how it is
# evaluated (a key and everything under it). The target is compared by what it serves
# (`TargetIdentity`, without its path), so moving or re-serving the same checkpoint resumes.
RESUMABLE_KEYS = (
    "output_dir", "run_name", "storage_path", "ray_address", "use_shared_pool", "eval",
    "train.workers", "train.use_gpu", "train.cpus_per_worker", "train.worker_resources",
    "train.steps", "train.prefetch", "train.checkpoint_every", "train.log_every",
    "train.max_failures", "train.max_controller_failures", "train.max_nonfinite_steps",
    "train.loggers",
    "train.mlflow_tracking_uri", "train.mlflow_experiment",
    "data.cpus_per_task", "data.tokenize_workers", "data.tokenize_in_driver_mb",
    "regenerate.conversations_per_wave", "regenerate.prompts_per_request", "target",
)
# ... except these, which no `TargetIdentity` field covers.
COMPARED_TARGET_KEYS = ("target.encoding_dtype",)
# What a served target may change on resume: where its checkpoint lies, and the longest row its
# engine accepts (vLLM's and the HF backend's differ for one checkpoint).
SERVING_DETAILS = ("model_path", "max_length")


class PreviousRun(NamedTuple):
    """The checkpoint a rerun resumes: its record (None if written before records existed) and
    its step."""

    record: dict[str, Any] | None
    step: int


def run_record(config: JobConfig, served: TargetIdentity) -> dict[str, Any]:
    """What a checkpoint of this job saves next to the draft (`RECORD_FILE`)."""
    return {"draft_settings": draft_settings(config), "target": served.to_dict()}


def draft_settings(config: JobConfig) -> dict[str, Any]:
    """`{dotted key: value}` of the settings that shape the draft (not in `RESUMABLE_KEYS`)."""
    return {key: value for key, value in flatten(to_dict(config)).items()
            if not _resumable(key)}


def run_path(config: JobConfig) -> str:
    """The Ray Train run folder (or URI) whose checkpoints a rerun of `config` resumes."""
    storage = config.storage_path or os.path.join(os.path.abspath(config.output_dir),
                                                  "ray_results")
    return os.path.join(storage, config.run_name)


def previous_run(config: JobConfig) -> PreviousRun | None:
    """The latest checkpoint this job would resume from, or None (no checkpoint)."""
    from ray.train import Result

    try:
        result = Result.from_path(run_path(config))
    except RuntimeError:  # no such run, or no checkpoint reported yet
        return None
    checkpoint = result.checkpoint
    if checkpoint is None:
        return None
    step = int((result.metrics or {}).get("step", 0))
    path = os.path.join(checkpoint.path, RECORD_FILE)
    if not checkpoint.filesystem.get_file_info(path).is_file:
        return PreviousRun(None, step)
    with checkpoint.filesystem.open_input_stream(path) as f:
        return PreviousRun(json.loads(f.read().decode()), step)


def check_resumable(config: JobConfig) -> PreviousRun | None:
    """Refuse (`ConfigError`) a rerun whose config changes what the resumed draft learned; log
    what a resume will do. Returns the run it resumes (for `check_resumed_target`), or None."""
    previous = previous_run(config)
    if previous is None:
        return None
    record, step = previous
    where = run_path(config)
    if record is None:
        logger.warning("run %r resumes from step %d (%s); its checkpoint predates run records, so "
                       "its settings cannot be compared with this job's", config.run_name, step,
                       where)
        return previous
    changed = settings_changed(record, config)
    if changed:
        raise ConfigError(
            f"run {config.run_name!r} has a checkpoint at step {step} ({where}) trained with other "
            f"settings ({'; '.join(changed)}); a rerun with the same run_name resumes that "
            f"draft. Use another run_name or output_dir to train a new draft, set these keys "
            f"back to resume it, or delete {where} to start it over")
    if config.train.steps is not None and step >= config.train.steps:
        logger.warning("run %r already reached step %d (train.steps=%d): it trains no more "
                       "steps, only exports and evaluates; raise train.steps to train longer",
                       config.run_name, step, config.train.steps)
    else:
        logger.info("run %r resumes from its checkpoint at step %d (%s)", config.run_name, step,
                    where)
    return previous


def check_resumed_target(previous: PreviousRun | None, served: TargetIdentity) -> None:
    """Refuse to resume a draft on supervision from another target than the one it learned."""
    if previous is None or previous.record is None:
        return
    before = TargetIdentity.from_dict(previous.record["target"])
    old, new = before.to_dict(), served.to_dict()
    changed = [f"{key}: {old[key]!r} -> {new[key]!r}" for key in old
               if key not in SERVING_DETAILS and old[key] != new[key]]
    if changed:
        raise ConfigError(
            f"the resumed run was trained on {before.describe()}; the pool serves "
            f"{served.describe()} ({'; '.join(changed)}). Use another run_name or output_dir "
            f"to train a draft for this target")


def settings_changed(record: dict[str, Any], config: JobConfig) -> list[str]:
    """`key: old -> new` for each setting that shapes the draft and differs from the recorded
    run's (a key a later version added, at its default, is no change)."""
    before, now = record["draft_settings"], draft_settings(config)
    return [f"{key}: {before[key]!r} -> {now[key]!r}" for key in sorted(before.keys() & now.keys())
            if before[key] != now[key]]


def _resumable(key: str) -> bool:
    if key in COMPARED_TARGET_KEYS:
        return False
    return any(key == prefix or key.startswith(prefix + ".") for prefix in RESUMABLE_KEYS)
