"""The pool's controller (pool/controller.py), the one owner of its replicas' lives: its
restarts, and its creator's end. Replicas are detached actors in every pool, so a controller that
dies takes no engine with it and its successor adopts them; the pool ends with its router, which
ends with the pool's creator. Replicas run the synthetic fixed-latency backend (the engine is not
under test here). Every kill lands at a state the test waited for, never after a sleep.
"""

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from eagle_ray.pool import PoolConfig, TargetPool
from eagle_ray.pool.replicas import RAY_GROUP_WARNING
from eagle_ray.ray_compat import actor_id

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    is_correct,
    micro_batches,
    placement_groups,
    replica_handle,
    replica_indices,
    replica_status,
    running_ray,
    synthetic_pool,
    wait_until,
)

pytestmark = pytest.mark.slow

NAMESPACE = "eagle_ray_test"
RESTART_S = 120  # an actor's restart on a loaded 2-core machine (ROUTER_RESTART_WAIT_S's)
# What Ray logs (core_worker.cc, CoreWorker::CreateActor) when a restartable actor's constructor
# arguments hold an object-store value or a non-detached actor's handle.
RAY_ARGUMENT_ERROR = "has constructor arguments in the object store"


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """Four CPUs: the test of a scale-up held mid-way counts on them."""
    with running_ray(num_cpus=4, namespace=NAMESPACE, runtime_env=TESTS_ON_WORKER_PATH):
        yield ray.get_runtime_context().gcs_address


def process_id(actor) -> int | None:
    """The actor's process id (None while it restarts): a new one says the restart happened."""
    try:
        return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def kill_and_wait_for_restart(actor) -> None:
    """SIGKILL-like `ray.kill` that lets Ray restart the actor, and wait until it has."""
    before = process_id(actor)
    ray.kill(actor, no_restart=False)
    wait_until(lambda: process_id(actor) not in (None, before), timeout_s=RESTART_S,
               what="the actor restarted")


def gone(name: str) -> bool:
    """Whether no actor holds `name` (it died for good; a restarting one keeps it)."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True
    return False


def serves(pool: TargetPool, seed: int) -> dict[str, int]:
    """Stream micro-batches through a fresh client, check each result; who served them."""
    client = pool.client()
    inputs = micro_batches(8, seed=seed)
    assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
    return dict(client.stats.served_by)


def test_a_controller_killed_mid_scale_up_adopts_every_live_replica_and_no_engine_restarts():
    """Its replicas are detached, so the restarted controller adopts them from its record: the
    same actors, processes and engines (served counts kept, no engine or process restart), the
    replica still waiting for its node included. Control: a replica killed for good along with
    the controller is replaced, and the status lists exactly the live replicas."""
    pool = synthetic_pool("adopt", replicas=2, cpus_per_bundle=1.5)  # 3 of the cluster's 4 CPUs
    config = pool.config
    try:
        assert set(serves(pool, seed=31)) <= {config.replica_name(i) for i in (0, 1)}
        attached = TargetPool.connect("adopt", NAMESPACE)  # it outlives this object
        added = attached.add_replica()
        del attached
        gc.collect()
        wait_until(lambda: ray.get(pool.controller.pending_groups.remote(), timeout=TIMEOUT_S)
                   == 1 and replica_status(pool, added)["state"] == "starting",
                   what="the added replica waiting for CPUs (mid-scale-up)")
        kept = {i: actor_id(replica_handle(pool, i)) for i in (0, added)}
        engine = ray.get(replica_handle(pool, 0).ready.remote(), timeout=TIMEOUT_S)
        ray.kill(replica_handle(pool, 1), no_restart=True)  # the control
        wait_until(lambda: gone(config.replica_name(1)), what="replica 1 dead for good")
        kill_and_wait_for_restart(pool.controller)

        # Replica 1's group goes with it; of the added replica and the one started in its
        # place, whichever group Ray places first gets its CPUs, the other waits.
        live = [0, added, added + 1]
        wait_until(lambda: sorted(pool.status()["replicas"]) == [config.replica_name(i)
                                                                 for i in live]
                   and pool.status()["ready_replicas"] == 2, timeout_s=RESTART_S,
                   what="the adopted replicas ready and replica 1 replaced")
        assert replica_indices(config) == live, "the status lists exactly the live replicas"
        assert sorted(ray.get(pool.controller.members.remote(), timeout=TIMEOUT_S)) == live
        assert {i: actor_id(replica_handle(pool, i)) for i in (0, added)} == kept, "adopted"
        again = ray.get(replica_handle(pool, 0).ready.remote(), timeout=TIMEOUT_S)
        assert (again.pid, again.served_micro_batches, again.engine.engine_restarts) == (
            engine.pid, engine.served_micro_batches, 0), "the same process and engine"
        ready = [i for i in live if replica_status(pool, i)["state"] == "ready"]
        assert 0 in ready
        for index in ready:
            status = replica_status(pool, index)
            own = ray.get(replica_handle(pool, index).ready.remote(), timeout=TIMEOUT_S)
            assert (status["pid"], status["restarts"]) == (own.pid, 0), index
        assert set(serves(pool, seed=32)) <= {config.replica_name(i) for i in ready}
    finally:
        pool.shutdown()
    wait_until(lambda: replica_indices(config) == [] and placement_groups(config) == [],
               what="shutdown removing the detached replicas and their groups")


def test_a_detached_pool_whose_router_and_controller_restart_together_keeps_its_replicas():
    """Neither can adopt from the other then: the controller's record in Ray's key-value store
    names the replicas, which outlive both, so the same actors serve again."""
    pool = synthetic_pool("both-restart", replicas=2, detached=True)
    try:
        before = {i: actor_id(replica_handle(pool, i)) for i in (0, 1)}
        pids = {actor: process_id(actor) for actor in (pool.router, pool.controller)}
        ray.kill(pool.router, no_restart=False)
        ray.kill(pool.controller, no_restart=False)
        wait_until(lambda: all(process_id(actor) not in (None, pid)
                               for actor, pid in pids.items()),
                   timeout_s=RESTART_S, what="the router and the controller restarted")
        wait_until(lambda: pool.status()["ready_replicas"] == 2, timeout_s=RESTART_S,
                   what="the router routing to the pool's replicas again")
        assert sorted(pool.status()["replicas"]) == [pool.config.replica_name(i) for i in (0, 1)]
        assert {i: actor_id(replica_handle(pool, i)) for i in (0, 1)} == before, "adopted"
        assert sorted(ray.get(pool.controller.members.remote(), timeout=TIMEOUT_S)) == [0, 1]
        serves(pool, seed=23)
        assert pool.add_replica() == 2, "the index counter came back with the record"
    finally:
        pool.shutdown()


# A pool's creator in a process of its own (as a job's driver, or `eagle-ray serve`): it starts
# the pool, then (with `control`) creates what Ray warns about: a restartable actor given a
# non-detached actor's handle, as the controller was given the router's (an `E` line), and a
# restartable detached actor in a group, as a replica is (a warning the controller drops); then
# it ends (`exit`, or `sigkill` itself).
CREATOR = """
import os, signal, sys
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from pool_helpers import TESTS_ON_WORKER_PATH, synthetic_pool
address, name, detached, control, end = sys.argv[1:]
ray.init(address=address, namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
pool = synthetic_pool(name, replicas=1, detached=detached == "detached")
print("POOL READY", file=sys.stderr, flush=True)
if control == "control":
    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self, handle=None):
            self.handle = handle
    holding = Holder.options(max_restarts=-1).remote(Holder.remote())
    group = placement_group([{"CPU": 0.01}], lifetime="detached")
    placed = Holder.options(lifetime="detached", max_restarts=-1,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(group)).remote()
    ray.get([holding.__ray_ready__.remote(), placed.__ray_ready__.remote()])
    ray.kill(placed, no_restart=True)
    remove_placement_group(group)
    print("CONTROL CREATED", file=sys.stderr, flush=True)
if end == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def run_creator(address: str, name: str, detached: bool, control: bool = False,
                end: str = "exit") -> str:
    """Run a pool's creator to its end; its stdout and stderr (Ray's own lines among them)."""
    done = subprocess.run(
        [sys.executable, "-c", CREATOR, address, name, "detached" if detached else "owned",
         "control" if control else "-", end],
        capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": TESTS_ON_WORKER_PATH["env_vars"]["PYTHONPATH"]})
    output = done.stdout + done.stderr
    assert done.returncode == (-signal.SIGKILL if end == "sigkill" else 0), output[-3000:]
    assert "POOL READY" in output, output[-3000:]
    return output


def ray_argument_errors(text: str, pool: str) -> list[str]:
    """Ray's error lines about constructor arguments in the object store, for `pool`'s actors
    (the message names the actor: `Actor <name> with class name ...`)."""
    return [line for line in text.splitlines()
            if RAY_ARGUMENT_ERROR in line and f"Actor {pool}-" in line]


def session_logs() -> str:
    """Every Ray process's log and output on this cluster (workers' C++ lines and stderr go
    there; what reaches a driver is a copy, and may come after it ended)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    return "\n".join(path.read_text(errors="replace") for path in logs.iterdir()
                     if path.is_file() and path.suffix in (".log", ".err", ".out"))


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_a_pool_starts_without_rays_error_and_ends_with_its_creator(cluster, end):
    """No `E` line at start: the controller's arguments hold nothing Ray keeps in the object
    store (it looks the router up by name). Control: the same process's restartable actor given
    a non-detached actor's handle gets the line. The replicas are detached, yet the creator's
    end removes them with their groups: its router ends with it and the controller follows."""
    name = f"ended-{end}"
    config = PoolConfig(name=name, namespace=NAMESPACE)
    output = run_creator(cluster, name, detached=False, control=True, end=end)
    started, control = output.split("POOL READY", 1)
    assert RAY_ARGUMENT_ERROR not in started, started[-3000:]
    assert RAY_ARGUMENT_ERROR in control and "Holder" in control, control[-3000:]
    assert RAY_GROUP_WARNING in control, control[-3000:]
    wait_until(lambda: replica_indices(config) == [] and placement_groups(config) == []
               and gone(config.controller_name) and gone(config.router_name),
               what="the pool removed after its creator ended")
    logs = session_logs()
    assert ray_argument_errors(logs, name) == []
    assert f"pool {name}: its router is gone" in logs, "the controller's log is read"
    assert RAY_GROUP_WARNING not in logs, "no warning about the replicas' groups"


def test_a_detached_pools_controller_killed_after_its_creator_exited_comes_back_and_serves(
        cluster):
    """As after `eagle-ray serve`: nothing of the creator is left, and the controller restarts
    from its constructor's arguments (the configuration, inline in its creation task) and
    adopts the replica; no `E` line at start either. Also the control of the test above: a
    detached pool outlives its creator."""
    output = run_creator(cluster, "served", detached=True)
    assert ray_argument_errors(output, "served") == []
    pool = TargetPool.connect("served", NAMESPACE)
    try:
        replica = actor_id(replica_handle(pool, 0))
        kill_and_wait_for_restart(pool.controller)
        wait_until(lambda: pool.status()["ready_replicas"] == 1, timeout_s=RESTART_S,
                   what="the pool ready again")
        assert actor_id(replica_handle(pool, 0)) == replica, "the same replica, adopted"
        assert set(serves(pool, seed=41)) == {pool.config.replica_name(0)}
        assert pool.add_replica() == 1, "the restarted controller starts replicas"
        pool.wait_ready(2, TIMEOUT_S)
    finally:
        pool.shutdown()
    assert ray_argument_errors(session_logs(), "served") == []
