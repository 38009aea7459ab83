"""Against a local `ray start --head`: `eagle-ray serve | status | shutdown` manage a shared pool,
`ray job submit` runs a short training job on it to success, a client without the cluster's
token cannot reach it, and `serve` refuses a cluster without token authentication. Each head is
started on free ports in its own temp dir, and only its own processes are stopped afterwards
(never another Ray on the machine)."""

import collections
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from eagle_ray.contract.identity import checkpoint_fingerprint
from eagle_ray.draft.export import exported_target
from eagle_ray.tiny import cache_root, tiny_target

from ray_heads import BIN, agent_port_args, free_port, short_temp_dir, stop_head

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def start_head(auth_mode: str):
    """`ray start --head` with the given auth mode: (env for its clients, addresses, stop)."""
    temp_dir = short_temp_dir()
    gcs_port, dashboard_port = free_port(), free_port()
    # The job's entrypoint runs with the head's PATH: start it with this environment first.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "RAY_AUTH_MODE": auth_mode, "EAGLE_RAY_CACHE": str(cache_root())}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([BIN / "ray", "start", "--head", f"--port={gcs_port}", "--num-cpus=2",
                    "--include-dashboard=true", f"--dashboard-port={dashboard_port}",
                    f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
                    *agent_port_args(),
                    "--object-store-memory=400000000", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=120)
    gcs = f"127.0.0.1:{gcs_port}"
    addresses = {"gcs": gcs, "dashboard": f"http://127.0.0.1:{dashboard_port}"}
    return env, addresses, lambda: stop_head(temp_dir, f":{gcs_port}")


@pytest.fixture(scope="module")
def head_node():
    """A head with token authentication, as the README's cluster path starts it."""
    subprocess.run([BIN / "ray", "get-auth-token", "--generate"], check=True,
                   capture_output=True, timeout=60)
    env, addresses, stop = start_head("token")
    yield env, addresses
    stop()


def submit(env, addresses, *entrypoint: str) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir <repo> -- <entrypoint>`; a head whose job agent has not
    registered yet refuses the submission (nothing was created), so that one is retried."""
    deadline = time.monotonic() + 180
    while True:
        result = subprocess.run(
            [BIN / "ray", "job", "submit", "--address", addresses["dashboard"],
             "--working-dir", str(ROOT), "--", *entrypoint],
            env=env, capture_output=True, text=True, timeout=900)
        if "No available agent to submit job" not in result.stderr + result.stdout \
                or time.monotonic() > deadline:
            return result
        time.sleep(5)


def eagle_ray(env, *args, timeout=300):
    return subprocess.run([BIN / "eagle-ray", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_a_clean_console(result: subprocess.CompletedProcess) -> str:
    """What the person who submitted the job reads: the job's own console, between `ray job
    submit`'s header and its closing status line; no traceback, no flood of repeated lines."""
    console = result.stdout.split("Tailing logs until the job exits", 1)[1]
    console = console.rsplit("Job '", 1)[0]
    assert "Traceback" not in console, console
    repeats = collections.Counter(line.strip() for line in console.splitlines()
                                  if line.strip() and set(line.strip()) != {"-"})
    assert max(repeats.values()) <= 2, repeats.most_common(3)
    return console


def test_serve_then_ray_job_submit_trains_on_the_shared_pool_then_status_and_shutdown(
        head_node, tmp_path):
    """The cluster path end to end; one job, which adopts the pool's aux layer ids (a job
    making its own pool is test_train's)."""
    env, addresses = head_node
    gcs = ["--address", addresses["gcs"]]
    # Non-default aux ids: the job joining the pool must adopt what the pool serves.
    served = eagle_ray(env, "serve", *gcs, "name=shared", "dtype=float32",
                       "aux_layer_ids=[0, 2, 5]")
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout)["ready_replicas"] == 1
    output_dir = tmp_path / "run"
    result = submit(env, addresses, "eagle-ray", "train", "--config", "examples/tiny.yaml",
                    "use_shared_pool=true", "target.name=shared", "train.steps=6",
                    "train.workers=1", "data.num_samples=96", "train.log_every=3",
                    "train.checkpoint_every=6", "eval.enabled=false",
                    f"output_dir={output_dir}", "run_name=shared-test")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout
    exported = json.loads((output_dir / "draft" / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # the pool's [0, 2, 5]
    trained_for = exported_target(output_dir / "draft")
    assert trained_for.aux_layer_ids == (0, 2, 5)
    assert trained_for.fingerprint == checkpoint_fingerprint(tiny_target("llama", pretrained=True))
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 2
    console = assert_a_clean_console(result)
    assert "eagle_ray run shared-test -- summary" in console
    assert f"vllm serve {cache_root()}" in console and "--speculative-config" in console
    assert (output_dir / "job.log").stat().st_size > 0  # where the rest went

    status = eagle_ray(env, "status", *gcs, "--name", "shared")
    assert status.returncode == 0, status.stderr[-3000:]
    replica = json.loads(status.stdout)["replicas"]["shared-replica-0"]
    assert replica["served_micro_batches"] >= 6  # one worker x 6 steps, served by the shared pool

    # Without the cluster's token (no RAY_AUTH_MODE, no ~/.ray/auth_token) nothing is reachable,
    # and the refusal is the authentication's ...
    outsider = {**env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    refused = eagle_ray(outsider, "status", *gcs, "--name", "shared", timeout=180)
    assert refused.returncode != 0 and "served_micro_batches" not in refused.stdout
    assert "auth" in (refused.stdout + refused.stderr).lower(), refused.stderr[-3000:]
    # ... not the swapped HOME's: with the token copied there, the same call goes through.
    (tmp_path / ".ray").mkdir(exist_ok=True)
    shutil.copy(Path.home() / ".ray" / "auth_token", tmp_path / ".ray" / "auth_token")
    holder = eagle_ray({**env, "HOME": str(tmp_path)}, "status", *gcs, "--name", "shared")
    assert holder.returncode == 0 and "served_micro_batches" in holder.stdout, holder.stderr

    assert eagle_ray(env, "shutdown", *gcs, "--name", "shared").returncode == 0
    gone = eagle_ray(env, "status", *gcs, "--name", "shared")
    assert gone.returncode == 2 and "no eagle_ray pool named 'shared'" in gone.stderr


def test_serve_refuses_a_cluster_without_token_authentication():
    env, addresses, stop = start_head("disabled")
    try:
        gcs = ["--address", addresses["gcs"]]
        refused = eagle_ray(env, "serve", *gcs, "name=open", "backend=hf", "dtype=float32")
        assert refused.returncode == 2
        assert "without token authentication" in refused.stderr
        assert "--allow-insecure" in refused.stderr
        allowed = eagle_ray(env, "serve", *gcs, "--allow-insecure", "name=open", "backend=hf",
                            "dtype=float32")
        assert allowed.returncode == 0, allowed.stderr[-3000:]
        assert json.loads(allowed.stdout)["ready_replicas"] == 1
    finally:
        stop()
