"""The router's choice of replica and the client's grouping of replica calls, as pure policies:
no Ray, no actors."""

import dataclasses
import itertools

from eagle_ray.pool.inflight import InFlightMicroBatch
from eagle_ray.pool.protocol import Lease, RequestKind
from eagle_ray.pool.replica_calls import group_calls
from eagle_ray.pool.routing import choose_replica
from eagle_ray.pool.states import ReplicaState

CAP = 100


@dataclasses.dataclass
class Replica:
    name: str
    outstanding_tokens: int = 0
    state: ReplicaState = ReplicaState.READY
    node_id: str | None = None


def choose(replicas, num_tokens=10, avoid=(), client_node=None):
    chosen = choose_replica(replicas, num_tokens, set(avoid), CAP, client_node)
    return None if chosen is None else chosen.name


def test_the_least_loaded_ready_replica_is_chosen():
    assert choose([Replica("a", 50), Replica("b", 20), Replica("c", 30)]) == "b"


def test_ties_go_to_the_lowest_name():
    assert choose([Replica("b", 5), Replica("a", 5)]) == "a"


def test_replicas_that_are_not_ready_are_never_chosen():
    replicas = [Replica("a", 90, ReplicaState.STARTING), Replica("b", 0, ReplicaState.SUSPECT),
                Replica("c", 0, ReplicaState.DRAINING), Replica("d", 40)]
    assert choose(replicas) == "d"
    assert choose(replicas[:3]) is None


def test_a_full_replica_is_skipped_and_all_full_means_wait():
    assert choose([Replica("a", 95), Replica("b", 60)], num_tokens=30) == "b"
    assert choose([Replica("a", 95), Replica("b", 80)], num_tokens=30) is None


def test_an_idle_replica_takes_a_micro_batch_larger_than_the_cap():
    assert choose([Replica("a")], num_tokens=5 * CAP) == "a"
    assert choose([Replica("a", 1)], num_tokens=5 * CAP) is None


def test_replicas_that_failed_this_micro_batch_are_avoided_while_others_exist():
    replicas = [Replica("a", 0), Replica("b", 70)]
    assert choose(replicas, avoid=["a"]) == "b"
    assert choose(replicas, avoid=["a", "b"]) == "a", "every replica failed it: try the best"
    assert choose([Replica("a", 0), Replica("b", 70, ReplicaState.SUSPECT)], avoid=["a"]) == "a"


def test_a_replica_on_the_clients_node_is_preferred_while_it_has_room():
    replicas = [Replica("a", 0, node_id="n1"), Replica("b", 60, node_id="n2")]
    assert choose(replicas, client_node="n2") == "b", "busier, but on-node and with room"
    assert choose(replicas, num_tokens=50, client_node="n2") == "a", "full on-node: go elsewhere"
    assert choose(replicas, client_node="n3") == "a", "no replica on-node: least-loaded"
    assert choose(replicas) == "a", "locality off: least-loaded"


def test_among_on_node_replicas_the_least_loaded_wins():
    replicas = [Replica("a", 30, node_id="n1"), Replica("b", 10, node_id="n1"),
                Replica("c", 0, node_id="n2")]
    assert choose(replicas, client_node="n1") == "b"


def test_locality_never_overrides_health_or_a_failed_attempt():
    replicas = [Replica("a", 0, ReplicaState.SUSPECT, node_id="n1"), Replica("b", 0, node_id="n2")]
    assert choose(replicas, client_node="n1") == "b", "the on-node replica is down: go elsewhere"
    replicas[0].state = ReplicaState.READY
    assert choose(replicas, client_node="n1") == "a", "and back once it is ready again"
    assert choose(replicas, avoid=["a"], client_node="n1") == "b", "it failed this one: elsewhere"



def leased(num_tokens: int, replica: str, kind: RequestKind = RequestKind.SUPERVISION):
    """A micro-batch (as the client records it) leased on `replica`."""
    item = InFlightMicroBatch(next(_ids), inputs=None, num_tokens=num_tokens, kind=kind)
    return item, Lease(replica, f"actor-{replica}", 0, num_tokens, expires=0.0)


_ids = itertools.count()


def test_micro_batches_leased_on_one_replica_at_once_share_a_call_in_order():
    pairs = [leased(10, "a"), leased(10, "b"), leased(10, "a"), leased(10, "b"), leased(10, "a")]
    calls = group_calls(pairs, max_micro_batches=8, max_tokens=1000)
    assert [[lease.replica for _, lease in call] for call in calls] == [["a", "a", "a"],
                                                                       ["b", "b"]]
    assert [item for item, _ in calls[0]] == [pairs[0][0], pairs[2][0], pairs[4][0]], "in order"


def test_a_call_holds_at_most_its_micro_batches_and_tokens_and_a_larger_one_goes_alone():
    pairs = [leased(10, "a") for _ in range(5)]
    assert [len(c) for c in group_calls(pairs, max_micro_batches=2, max_tokens=1000)] == [2, 2, 1]
    pairs = [leased(60, "a"), leased(50, "a"), leased(500, "a"), leased(30, "a")]
    assert [[i.num_tokens for i, _ in c] for c in group_calls(pairs, 8, max_tokens=100)] == [
        [60], [50], [500], [30]]
    assert [len(c) for c in group_calls(pairs, 1, max_tokens=10_000)] == [1, 1, 1, 1], \
        "max_micro_batches_per_call: 1 is a call each"


def test_text_generation_never_shares_a_call():
    pairs = [leased(10, "a"), leased(10, "a", RequestKind.COMPLETION), leased(10, "a")]
    calls = group_calls(pairs, max_micro_batches=8, max_tokens=1000)
    assert [[i.kind for i, _ in c] for c in calls] == [
        [RequestKind.SUPERVISION, RequestKind.SUPERVISION], [RequestKind.COMPLETION]]
