"""Non-finite supervision never reaches a trainer (issue 53, item 3): a real Ray cluster, two
replicas of the HF backend on the tiny Llama whose embedding writes NaN wherever a row holds a
poisoned token (`eagle_ray.testing.poisoned_hf_target`: the real forward carries it to those
rows only). Token `TARGET_NAN` is poisoned on every replica (the target's own fault), token
`BROKEN_NAN` on replica 0 only (a broken replica). Every clean micro-batch is compared with the
HF backend called in this process; each test has its control without the poison."""

import pytest
import ray
import torch

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.contract.finite import nonfinite_fields
from eagle_ray.pool import ClientConfig, PoolClient, PoolConfig, TargetPool
from eagle_ray.pool.protocol import NonFiniteSupervision
from eagle_ray.pool.transport import batch_from_numpy, pack_inputs
from eagle_ray.testing import random_micro_batch

from pool_helpers import TIMEOUT_S, replica_handle, results_or_errors, running_ray, wait_until
from reference_checks import assert_matches_reference

pytestmark = pytest.mark.slow

TARGET_NAN = 2  # random_micro_batch draws ids from 3 up: neither poisoned token occurs by chance
BROKEN_NAN = 1
POISONED_ROW = 1
# A client that hands every lease back at once, so the router's next choice starts from no load
# (ties go to the lowest replica name: replica 0).
ONE_LEASE_EACH = ClientConfig(lease_reuse_s=0)


@pytest.fixture(scope="module")
def pool(llama_path):
    with running_ray(num_cpus=4, namespace="eagle_ray_test"):
        pool = TargetPool.create(PoolConfig(
            model_path=str(llama_path), backend="eagle_ray.testing:poisoned_hf_target",
            dtype="float32", name="nonfinite", namespace="eagle_ray_test", replicas=2,
            backend_kwargs={"poison": [[TARGET_NAN, None], [BROKEN_NAN, [0]]]}))
        try:
            yield pool
        finally:
            pool.shutdown()


def micro_batch(seed: int, poison: int | None = None):
    """Three rows; with `poison`, row `POISONED_ROW` holds that token."""
    ids, attention, loss = random_micro_batch(604, (7, 9, 5), seed=seed)
    if poison is not None:
        ids[POISONED_ROW, 3] = poison
    return ids, attention, loss


def engine_stats(pool, index: int):
    return ray.get(replica_handle(pool, index).ready.remote(), timeout=TIMEOUT_S).engine


def refused(pool) -> list[int]:
    return [engine_stats(pool, i).nonfinite_refused for i in range(2)]


def idle(pool) -> None:
    """No lease outstanding (the reports of earlier clients reach the router in the background)."""
    wait_until(lambda: pool.status()["demand_tokens"] == 0, what="every lease back")


@pytest.mark.parametrize("poisoned", [True, False], ids=["poisoned", "control"])
def test_a_replica_refuses_the_poisoned_micro_batch_of_a_merged_call_alone(pool, hf_llama,
                                                                           llama_path, poisoned):
    parts = [micro_batch(1), micro_batch(2, TARGET_NAN if poisoned else None), micro_batch(3)]
    before = engine_stats(pool, 0)
    answers = ray.get(replica_handle(pool, 0).generate_many.remote(
        [10, 11, 12], *[pack_inputs(*p) for p in parts]), timeout=TIMEOUT_S)
    after = engine_stats(pool, 0)
    # One engine call carried the three micro-batches.
    assert (after.engine_calls - before.engine_calls, after.merged_calls - before.merged_calls,
            after.micro_batches - before.micro_batches) == (1, 1, 3)
    assert after.nonfinite_refused - before.nonfinite_refused == int(poisoned)
    if poisoned:
        error = answers[1]
        assert isinstance(error, NonFiniteSupervision), error
        message = str(error)
        assert f"replica {pool.config.replica_name(0)} (node " in message
        assert "micro-batch 11 (3 rows x 9 positions)" in message
        # Which tensors, how many NaN and inf, which rows: what this process computes for the
        # same poison on the same model.
        local = HFEagle3TargetModel.from_pretrained(llama_path, dtype=torch.float32)
        local.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out.masked_fill((args[0] == TARGET_NAN).unsqueeze(-1),
                                                      float("nan")))
        expected = nonfinite_fields(local.generate_batch(*parts[1]))
        assert [f.name for f in expected] == ["aux_hidden_states", "last_hidden"]
        assert {f.rows for f in expected} == {(POISONED_ROW,)} and expected[0].nan > 0
        for field in expected:
            assert str(field) in message, (field, message)
    served = [0, 2] if poisoned else [0, 1, 2]
    assert [i for i, a in enumerate(answers) if isinstance(a, dict)] == served
    for i in served:
        assert_matches_reference(batch_from_numpy(answers[i]), hf_llama.generate_batch(*parts[i]),
                                 hf_llama.get_target_head())


@pytest.mark.parametrize("poisoned", [True, False], ids=["poisoned", "control"])
def test_the_targets_own_nan_fails_its_micro_batch_after_two_replicas_the_rest_arrive(
        pool, hf_llama, poisoned):
    """Poisoned on every replica: tried on both, then the caller's `NonFiniteSupervision`;
    the stream's other micro-batches arrive right."""
    idle(pool)
    before = refused(pool)
    client = PoolClient.connect(pool.config.name, "eagle_ray_test", ONE_LEASE_EACH)
    inputs = [micro_batch(20 + i, TARGET_NAN if poisoned and i == 2 else None) for i in range(5)]
    ids = [client.submit(*x) for x in inputs]
    answers = results_or_errors(client, ids, NonFiniteSupervision)
    if poisoned:
        assert isinstance(answers[2], NonFiniteSupervision), answers[2]
        message = str(answers[2])
        assert message.startswith("non-finite supervision from 2 replica(s), the last: replica ")
        assert f"micro-batch {ids[2]} " in message and "row(s) [1]" in message
        assert [a - b for a, b in zip(refused(pool), before, strict=True)] == [1, 1]
        assert client.stats.retries == 1
    else:
        assert refused(pool) == before and client.stats.retries == 0
    for i, (x, answer) in enumerate(zip(inputs, answers, strict=True)):
        if not (poisoned and i == 2):
            assert_matches_reference(answer, hf_llama.generate_batch(*x),
                                     hf_llama.get_target_head())


@pytest.mark.parametrize("poisoned", [True, False], ids=["poisoned", "control"])
def test_a_broken_replicas_nan_is_served_by_the_other_replica(pool, hf_llama, poisoned):
    """Poisoned on replica 0 only, where the router sends a lone micro-batch first: refused
    there, tried once more on replica 1, which serves it right. The control (no poison) is
    served by replica 0 at once, so the retry is not an accident of routing."""
    idle(pool)
    before = refused(pool)
    client = PoolClient.connect(pool.config.name, "eagle_ray_test", ONE_LEASE_EACH)
    inputs = micro_batch(30, BROKEN_NAN if poisoned else None)
    (result,) = client.stream([inputs])
    assert_matches_reference(result, hf_llama.generate_batch(*inputs), hf_llama.get_target_head())
    replicas = [pool.config.replica_name(i) for i in range(2)]
    if poisoned:
        assert [a - b for a, b in zip(refused(pool), before, strict=True)] == [1, 0]
        assert client.stats.retries == 1 and dict(client.stats.served_by) == {replicas[1]: 1}
    else:
        assert refused(pool) == before
        assert client.stats.retries == 0 and dict(client.stats.served_by) == {replicas[0]: 1}
