"""Every record that crosses an actor boundary in the pool, typed: what a replica reports, what
the router grants and is told, what the controller reads and reports, the pool's status and a
client's counters, and the router's errors. The router, the client, the replica, the controller
and `TargetPool` import these instead of each other (nothing here imports torch or Ray).

`PoolStatus.to_dict()` is the one place records become plain data: `TargetPool.status()` and
`eagle-ray status` hand users JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Any, NamedTuple

from eagle_ray.config.loader import ConfigError
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.pool.states import ReplicaState

# ---------------------------------------------------------------- client <-> replica


class RequestKind(enum.Enum):
    """What a client asks a replica for: supervision (micro-batches leased on one replica at
    once share a `generate_many` call, merged on the engine) or text (`complete`, a call
    each)."""

    SUPERVISION = "supervision"
    COMPLETION = "completion"


@dataclasses.dataclass
class EngineStats:
    """A replica's engine pipeline (`EngineQueue`): calls, micro-batches in them, calls that
    merged several, micro-batches queued or inside now, seconds the engine ran (`engine_s`: over
    wall time, its utilisation), seconds the host stage turned engine output into supervision
    (`host_s`, beside the engine when pipelined), requests whose captured states found
    vLLM's shared-memory ring full (`handoff_overflows`), engines rebuilt in place after
    running out of memory broke them (`engine_restarts`), and micro-batches refused for NaN or
    inf in their supervision (`nonfinite_refused`)."""

    engine_calls: int = 0
    micro_batches: int = 0
    merged_calls: int = 0
    inside: int = 0
    engine_s: float = 0.0
    host_s: float = 0.0
    handoff_overflows: int = 0
    engine_restarts: int = 0
    nonfinite_refused: int = 0


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """A replica's answer to `ready()` (the router's liveness probe): where it runs and, once its
    backend is built, what its target accepts; `startup_error` when it could not be built."""

    index: int
    node_id: str
    pid: int
    startup_error: str | None = None
    gpu_ids: list[str] = dataclasses.field(default_factory=list)
    vocab_size: int = 0
    max_length: int | None = None
    aux_layer_ids: list[int] = dataclasses.field(default_factory=list)
    identity: TargetIdentity | None = None
    served_tokens: int = 0
    served_micro_batches: int = 0
    engine: EngineStats = dataclasses.field(default_factory=EngineStats)
    max_tokens_per_engine_call: int = 0


# ---------------------------------------------------------------- client <-> router

# A lease as granted: the replica's actor name and id (the client keeps a handle per id), the
# lease's id (what the client reports it by), and how many seconds after the request reached the
# router its term started (the client dates the lease from its request plus these).
Grant = tuple[str, str, int, float]


@dataclasses.dataclass(frozen=True)
class LeaseOwner:
    """Who holds a client's leases, so the router can take them back from a client that died:
    `key` names the client; `alive` is `[ref]` of an object the client put (in a list, so the
    router receives the ref and not its value): reading it fails once the client's process is
    gone. `term_s`: how long the client may hold a lease without reporting it (one attempt's
    timeout plus `lease_reuse_s`); the router takes back a lease silent longer than that."""

    key: str
    alive: list[Any]
    term_s: float


class LeaseRequest(NamedTuple):
    """One micro-batch waiting for a lease: its id, tokens, and replicas it failed on."""

    micro_batch_id: int
    num_tokens: int
    avoid: list[str]


@dataclasses.dataclass
class Lease:
    """Room for `tokens` on a replica, granted by the router; passed on until `expires`. From
    `lapses` on the router may have taken it back (the client was away past its term and the
    router's grace): no attempt starts on it that would end after that."""

    replica: str
    actor_id: str
    lease_id: int
    tokens: int
    expires: float  # time.monotonic()
    lapses: float = math.inf  # time.monotonic()


class LeaseReport(NamedTuple):
    """What a client tells the router about a lease: a micro-batch's outcome on it (`ok`; None
    when there is none: a lease handed back unused) and, once the client hands the lease back,
    its tokens (`returned_tokens`; None while the client passes it on to its next micro-batch).
    A report on a lease the router already took back (`lease_id` unknown) is late: it counts no
    tokens, only its outcome."""

    replica: str
    served_tokens: int
    ok: bool | None
    replica_died: bool = False
    returned_tokens: int | None = None
    lease_id: int = -1


Releases = list[LeaseReport] | tuple[()]


@dataclasses.dataclass
class ClientStats:
    """A client's counters (`PoolClient.stats`). retries: attempts re-run after a failure, of
    which reruns_on_same_replica landed on a replica that had already failed them;
    router_retries: calls to an unavailable router; reused_leases: micro-batches run on a lease
    passed on from a finished one (no router call); replica_calls: calls to replicas (several
    micro-batches can share one); served_by: results received per replica; lapsed_leases: leases
    the client found past their term when it came back from a stall (the router may have taken
    them back): handed back, their micro-batches re-run on fresh ones, no attempt or replica
    charged."""

    submitted: int = 0
    delivered: int = 0
    retries: int = 0
    reruns_on_same_replica: int = 0
    abandoned_attempts: int = 0
    router_retries: int = 0
    max_inflight: int = 0
    wait_seconds: float = 0.0
    reused_leases: int = 0
    replica_calls: int = 0
    lapsed_leases: int = 0
    served_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)


# ---------------------------------------------------------------- router <-> controller


@dataclasses.dataclass(frozen=True)
class Demand:
    """What the autoscaling controller reads from the router: tokens leased or waiting for a
    lease, and each replica's state and outstanding tokens."""

    tokens: int
    waiting_tokens: int
    replicas: dict[str, tuple[ReplicaState, int]]


@dataclasses.dataclass(frozen=True)
class ScalingEvent:
    """One autoscaling decision: when (epoch seconds), from and to how many replicas, why."""

    at: float
    replicas_before: int
    replicas_after: int
    reason: str


@dataclasses.dataclass(frozen=True)
class AutoscalingReport:
    """The controller's latest view, shown in the pool's status: its bounds, replicas desired,
    ready, starting, failed, counted and being removed, its counts so far, its last decision and
    why it stopped adding replicas (`blocked`)."""

    min_replicas: int
    max_replicas: int
    target_outstanding_tokens_per_replica: int
    desired: int
    ready: int
    starting: int
    failed: int
    replicas: int
    removing: int
    scale_ups: int
    scale_downs: int
    replicas_added: int
    replicas_removed: int
    last_decision: ScalingEvent | None
    blocked: str | None
    rounds: int


# ---------------------------------------------------------------- router -> TargetPool


@dataclasses.dataclass(frozen=True)
class ReplicaStatus:
    """One replica in the pool's status."""

    index: int  # what `TargetPool.remove_replica` takes
    state: ReplicaState
    outstanding_tokens: int
    outstanding_micro_batches: int
    peak_outstanding_tokens: int
    served_tokens: int
    served_micro_batches: int
    tokens_per_s: float
    on_node_share: float | None  # of its leases, the share whose client ran on its node
    errors: int
    restarts: int
    node_id: str | None
    pid: int | None
    error: str | None  # why it could not start (state FAILED)


@dataclasses.dataclass(frozen=True)
class RouterProcess:
    """The router's own process (its memory stays flat under load: tested)."""

    pid: int
    rss_bytes: int


@dataclasses.dataclass(frozen=True)
class PoolStatus:
    """The router's view of the pool: its replicas, leases granted, router calls, locality,
    demand, the autoscaling controller's report and the router process itself. Leases: granted
    (`leases`), held now (`leases_held`), taken back from clients that died or stayed silent
    past their term (`leases_taken_back`), and reports that came after (`late_reports`: a
    stalled client's, counted once)."""

    replicas: dict[str, ReplicaStatus]
    ready_replicas: int
    leases: int
    lease_calls: int
    leases_taken_back: int  # from clients that died or stayed silent past their term
    late_reports: int  # on leases taken back before (they return no tokens)
    leases_held: int  # granted and neither handed back nor taken back
    locality: bool
    on_node_share: float | None
    demand_tokens: int
    autoscaling: AutoscalingReport | None
    router: RouterProcess

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (states as their names' values)."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- errors


class MicroBatchFailed(RuntimeError):
    """A micro-batch could not be served; the message says where it was tried and why."""


MEMORY_ADVICE = ("send smaller micro-batches (data.max_tokens_per_micro_batch, "
                 "data.micro_batch_size; the pool merges at most "
                 "target.max_tokens_per_engine_call), give the engine more memory "
                 "(target.vllm_kwargs.gpu_memory_utilization) or lower "
                 "target.vllm_kwargs.max_model_len")


class MicroBatchOutOfMemory(RuntimeError):
    """The target engine ran out of memory on a micro-batch (the message: its size, the
    engine's error, what to change). The replica that raised it keeps serving."""

    @classmethod
    def of(cls, error: BaseException, rows: int, seq: int, tokens: int) -> MicroBatchOutOfMemory:
        return cls(f"the target engine ran out of memory on a micro-batch of {tokens} tokens "
                   f"({rows} rows x {seq} padded positions): {type(error).__name__}: "
                   f"{str(error)[:300]} -- {MEMORY_ADVICE}")


NONFINITE_ADVICE = ("a draft trained on them turns NaN. The pool tries such a micro-batch once "
                    "more on another replica (a broken device or weight shard is one "
                    "replica's); where two replicas return them, the target itself does for "
                    "these rows: serve it in bfloat16 or float32 rather than float16 "
                    "(target.dtype) and check its checkpoint for NaN or inf weights")


class NonFiniteSupervision(RuntimeError):
    """The target engine returned NaN or inf for a micro-batch, and the replica refused to send
    it (the message: which tensors, how many NaN and inf, the rows, the micro-batch and the
    replica). The replica keeps serving; the other micro-batches of its engine call arrive."""

    @classmethod
    def of(cls, what: str, micro_batch_id: int, replica: str, rows: int, seq: int
           ) -> NonFiniteSupervision:
        """The error for micro-batch `micro_batch_id` (`rows` x `seq`) on `replica`; `what`:
        the non-finite tensors (`contract.finite.NonFiniteField`s, joined)."""
        return cls(f"{replica} refused micro-batch {micro_batch_id} ({rows} rows x {seq} "
                   f"positions): its engine returned non-finite supervision -- {what}; "
                   f"{NONFINITE_ADVICE}")


class NoReplicaAvailable(RuntimeError):
    """No replica could take a micro-batch in time; the message lists the replicas' states."""


class ReplicaStartupError(ConfigError):
    """Replicas could not build their target backend (the engine's own error, and the config
    key to change); the same configuration would fail on every replica, so the pool stops."""

    @classmethod
    def of(cls, pool: str, errors: dict[str, str], replicas: int) -> ReplicaStartupError:
        """The error for `errors` (replica name -> its start-up error) among `replicas`."""
        name, error = next(iter(sorted(errors.items())))
        return cls(f"{len(errors)} of {replicas} replicas of pool {pool!r} could not start "
                   f"their target backend ({name}: {error})")
