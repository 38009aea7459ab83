"""Against a local `ray start --head`: `ray job submit` runs a short training job to success,
and `eagle-ray serve | status | shutdown` manage a shared pool that a job can join."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the environment's ray / eagle-ray / python


@pytest.fixture
def head_node(tmp_path):
    # The job's entrypoint runs with the head's PATH: start it with this environment first.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([BIN / "ray", "start", "--head", "--num-cpus=4", "--include-dashboard=true",
                    "--dashboard-port=8265", "--object-store-memory=400000000",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=120)
    yield env
    subprocess.run([BIN / "ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_runs_training_to_success(head_node, tmp_path):
    output_dir = tmp_path / "run"
    result = subprocess.run(
        [BIN / "ray", "job", "submit", "--address", "http://127.0.0.1:8265",
         "--working-dir", str(ROOT), "--",
         "eagle-ray", "train", "--config", "examples/tiny.yaml", "train.steps=10",
         "train.log_every=5", "train.checkpoint_every=10", "eval.enabled=false",
         "target.name=job-pool", f"output_dir={output_dir}", "run_name=job-test"],
        env=head_node, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout
    assert (output_dir / "draft" / "config.json").exists()
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_serve_status_shutdown_and_a_job_that_joins_the_shared_pool(head_node, tmp_path):
    def eagle_ray(*args, timeout=300):
        return subprocess.run([BIN / "eagle-ray", *args], env=head_node, capture_output=True,
                              text=True, timeout=timeout)

    served = eagle_ray("serve", "name=shared", "dtype=float32")
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout)["ready_replicas"] == 1
    result = subprocess.run(
        [BIN / "ray", "job", "submit", "--address", "http://127.0.0.1:8265",
         "--working-dir", str(ROOT), "--",
         "eagle-ray", "train", "--config", "examples/tiny.yaml", "use_shared_pool=true",
         "target.name=shared", "train.steps=6", "train.log_every=3", "train.checkpoint_every=6",
         "eval.enabled=false", f"output_dir={tmp_path / 'run'}", "run_name=shared-test"],
        env=head_node, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    status = eagle_ray("status", "--name", "shared")
    assert status.returncode == 0, status.stderr[-3000:]
    replica = json.loads(status.stdout)["replicas"]["shared-replica-0"]
    assert replica["served_micro_batches"] >= 12  # 2 workers x 6 steps, served by the shared pool
    assert eagle_ray("shutdown", "--name", "shared").returncode == 0
    gone = eagle_ray("status", "--name", "shared")
    assert gone.returncode == 2 and "no eagle_ray pool named 'shared'" in gone.stderr
