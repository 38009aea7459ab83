"""The pool's and the pool client's configuration (README: "Pool config keys").

Unknown keys and wrong types are errors (`eagle_ray.config.loader`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from eagle_ray.config.loader import ConfigError


@dataclasses.dataclass
class AutoscalingConfig:
    """Replicas follow demand (README, "Autoscaling"); the keys follow Ray Serve's
    `autoscaling_config`. Demand is tokens leased or waiting for a lease."""

    min_replicas: int = 1
    max_replicas: int = 4
    # Add replicas while demand per replica (ready or still starting) stays above this.
    target_outstanding_tokens_per_replica: int = 8192
    upscale_delay_s: float = 30.0  # demand must stay above target this long before adding
    downscale_delay_s: float = 600.0  # ... and below it this long before removing (draining)
    interval_s: float = 1.0  # how often the controller reads demand and decides

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"autoscaling needs 0 <= min_replicas <= max_replicas and "
                              f"max_replicas >= 1, got {self.min_replicas} and "
                              f"{self.max_replicas}")
        if self.target_outstanding_tokens_per_replica < 1:
            raise ConfigError("autoscaling.target_outstanding_tokens_per_replica must be >= 1")
        if min(self.upscale_delay_s, self.downscale_delay_s) < 0 or self.interval_s <= 0:
            raise ConfigError("autoscaling delays must be >= 0 and interval_s > 0")


@dataclasses.dataclass
class PoolConfig:
    """What `TargetPool` builds. Every key is documented in the README ("Pool config keys")."""

    model_path: str | None = None  # None: the tiny built-in Llama target (eagle_ray.tiny)
    backend: str = "vllm"  # "vllm", "hf", or "package.module:factory" (factory(config) -> backend)
    replicas: int = 1
    tp_size: int = 1
    dtype: str = "auto"
    aux_layer_ids: list[int] | None = None
    encoding: Literal["last_hidden", "logits"] = "last_hidden"
    # How hidden states travel: "auto" in the engine's dtype, "fp8" as float8 e4m3 with a scale
    # per token and layer (half of bf16's bytes; the trainer dequantises; eagle_ray.fp8).
    encoding_dtype: Literal["auto", "fp8"] = "auto"
    vllm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    backend_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Placement: one group per replica, one bundle per TP rank.
    use_gpu: bool = False
    cpus_per_bundle: float = 1.0
    bundle_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    runtime_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Naming: actors live in `namespace`; a detached pool outlives the job that made it.
    name: str = "eagle_ray_pool"
    namespace: str = "eagle_ray"
    detached: bool = False
    # Custom resources of the router actor (it needs no CPU), e.g. {"head": 0.001} to keep it on
    # the head node, off workers that an autoscaler may reclaim.
    router_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    # Load: the router keeps at most this many tokens outstanding on one replica.
    max_outstanding_tokens_per_replica: int = 16384
    # A replica accepts this many calls at once (a call carries one micro-batch or several);
    # micro-batches waiting together are merged into one engine call (sharing engine steps) of
    # at most `max_tokens_per_engine_call` padded slots (rows x longest row; a larger
    # micro-batch runs alone). 1: one call at a time.
    replica_concurrency: int = 4
    max_tokens_per_engine_call: int = 16384
    # Locality: lease a replica on the client's own node while it has room (its results then
    # stay in that node's shared memory instead of crossing the network).
    locality: bool = True
    # Autoscaling: None keeps `replicas` fixed; set, the pool starts `min_replicas` (or
    # `replicas`, if larger and within bounds) and a controller adds and removes replicas.
    autoscaling: AutoscalingConfig | None = None
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {self.replicas}")
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.max_outstanding_tokens_per_replica < 1:
            raise ConfigError("max_outstanding_tokens_per_replica must be >= 1")
        if self.replica_concurrency < 1 or self.max_tokens_per_engine_call < 1:
            raise ConfigError("replica_concurrency and max_tokens_per_engine_call must be >= 1")
        if self.backend not in ("vllm", "hf") and ":" not in self.backend:
            raise ConfigError(f"backend must be 'vllm', 'hf' or 'module:factory', "
                              f"got {self.backend!r}")

    # Every name the pool gives its actors and placement groups comes from here.

    @property
    def router_name(self) -> str:
        return f"{self.name}-router"

    @property
    def initial_replicas(self) -> int:
        """Replicas the pool starts with: `replicas`, within the autoscaling bounds if any."""
        if self.autoscaling is None:
            return self.replicas
        return min(max(self.replicas, self.autoscaling.min_replicas),
                   self.autoscaling.max_replicas)

    @property
    def controller_name(self) -> str:
        return f"{self.name}-controller"

    def replica_name(self, index: int) -> str:
        return f"{self.replica_prefix}{index}"

    @property
    def replica_prefix(self) -> str:
        return f"{self.name}-replica-"

    def placement_group_name(self, index: int) -> str:
        return f"{self.replica_name(index)}-pg"


@dataclasses.dataclass
class ClientConfig:
    """Per-client flow control and retry policy."""

    max_inflight_micro_batches: int = 8  # submitted but not yet consumed (backpressure)
    max_inflight_tokens: int = 65536
    timeout_s: float = 600.0  # one attempt on one replica; then it is re-run elsewhere
    max_attempts: int = 4
    lease_timeout_s: float = 600.0  # waiting for any replica to accept a micro-batch
    # A granted lease passes from a finished micro-batch to the next waiting one without a router
    # call for this long, then goes back (so new, drained and restarted replicas are seen); 0:
    # one lease per micro-batch.
    lease_reuse_s: float = 5.0
    # Micro-batches leased on one replica at the same moment travel in one call (one Ray call
    # each way instead of one per micro-batch; they merge on the engine anyway), up to this many,
    # half the window and the replica's `max_tokens_per_engine_call`; 1: a call per micro-batch.
    max_micro_batches_per_call: int = 8
