"""A Ray Train worker SIGKILLed mid-job: the job resumes from its last checkpoint by itself
(`train.max_failures`), says so in the driver's log (the console and job.log), and
metrics.jsonl keeps one record per step.

The moment is the test's: the pool's target (the HF backend behind a gate) holds every call
while the gate file exists, so the worker is killed after a checkpoint and before the job can
end, whatever the machine's speed.
"""

import json
import logging
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest

from eagle_ray.config import JobConfig, load_yaml
from eagle_ray.tiny import tiny_target
from eagle_ray.train.job import run_job

from pool_helpers import running_ray, wait_until

ROOT = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY, LOG_EVERY = 20, 5, 5

pytestmark = pytest.mark.slow


def train_worker_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]


def registered_checkpoint(run_storage: Path) -> bool:
    """Whether Ray Train's checkpoint manager has registered a checkpoint (written into its
    snapshot): what a restarted worker group resumes from."""
    snapshot = run_storage / "checkpoint_manager_snapshot.json"
    try:
        return json.loads(snapshot.read_text()).get("latest_checkpoint_result") is not None
    except (OSError, ValueError):
        return False


def test_a_killed_train_worker_resumes_from_its_checkpoint_with_one_record_per_step(
        tmp_path, caplog):
    gate = tmp_path / "hold"
    config = load_yaml(JobConfig, ROOT / "examples" / "tiny.yaml", [
        f"target.model_path={tiny_target('llama', pretrained=True)}",
        "target.backend=eagle_ray.testing:gated_hf_target",
        f"target.backend_kwargs={{hold_while: {gate}}}", "target.name=recovery-test",
        "target.namespace=eagle_ray_test", "data.num_samples=64", "data.eval_samples=4",
        "regenerate.enabled=false", "eval.enabled=false", f"train.steps={STEPS}",
        f"train.checkpoint_every={CHECKPOINT_EVERY}", f"train.log_every={LOG_EVERY}",
        "train.warmup_steps=5", "train.max_failures=2", f"output_dir={tmp_path / 'run'}",
        "run_name=recovery-test"])
    outcome: dict = {}

    def job() -> None:
        try:
            outcome["summary"] = run_job(config)
        except BaseException as e:  # noqa: BLE001 -- the assertion below shows it
            outcome["error"] = e

    caplog.set_level(logging.WARNING, logger="eagle_ray")
    with running_ray(object_store_mb=400):
        thread = threading.Thread(target=job)
        thread.start()
        wait_until(lambda: registered_checkpoint(tmp_path / "run" / "ray_results"
                                                 / "recovery-test"),
                   timeout_s=600, what="a checkpoint Ray Train registered")
        gate.touch()  # the trainers wait on the pool from now on: the job cannot end
        wait_until(lambda: len(train_worker_pids()) == config.train.workers,
                   what="the train workers")
        os.kill(train_worker_pids()[0], signal.SIGKILL)
        gate.unlink()
        thread.join(900)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["final_metrics"]["step"] == STEPS
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), "one record per step"
    resumed = [r.getMessage() for r in caplog.records if "resumed from its checkpoint" in
               r.getMessage()]
    assert len(resumed) == 1 and any(f"at step {s}" in resumed[0]
                                     for s in range(CHECKPOINT_EVERY, STEPS, CHECKPOINT_EVERY))
