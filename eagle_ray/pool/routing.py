"""Which replica serves a micro-batch: a pure policy, fed the replicas' loads, tested without Ray.

The router actor gathers the inputs (states, outstanding tokens, nodes) and applies the choice;
the choice itself lives here, as Ray Serve keeps its request routers apart from the actors using
them.

Locality: a replica's result is a few hundred MB of supervision per micro-batch. A client on the
replica's node maps it from shared memory; a client on another node has Ray's object manager pull it
over the network, ten to a hundred times slower (docs/architecture.md, "Locality"). So a replica on
the client's node is preferred while it has room, and the least-loaded replica anywhere takes the
micro-batch otherwise: locality never makes a client wait while another replica could serve it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol, TypeVar

from eagle_ray.pool.states import ReplicaState


class ReplicaLoad(Protocol):
    """What the policy reads of a replica."""

    name: str
    state: ReplicaState
    outstanding_tokens: int  # leased to clients and not yet released
    node_id: str | None  # where it runs; None until it first reported ready


R = TypeVar("R", bound=ReplicaLoad)


def choose_replica(replicas: Iterable[R], num_tokens: int, avoid: Collection[str],
                   max_outstanding_tokens: int, client_node: str | None = None) -> R | None:
    """The ready replica with the fewest outstanding tokens that has room for `num_tokens`,
    one on `client_node` first when any there has room.

    Replicas named in `avoid` (where this micro-batch already failed) are passed over while any
    other ready replica exists. An idle replica takes any micro-batch, even one larger than
    `max_outstanding_tokens`, so no micro-batch waits forever. None: every candidate is full
    (backpressure) or none is ready. Ties go to the lowest name, so the choice is deterministic.
    `client_node` None (locality off, or a client that does not say) weighs every node alike.
    """
    ready = [r for r in replicas if r.state is ReplicaState.READY]
    preferred = [r for r in ready if r.name not in avoid] or ready
    fits = [r for r in preferred if r.outstanding_tokens == 0
            or r.outstanding_tokens + num_tokens <= max_outstanding_tokens]
    on_node = [r for r in fits if client_node is not None and r.node_id == client_node]
    return min(on_node or fits, key=lambda r: (r.outstanding_tokens, r.name), default=None)
