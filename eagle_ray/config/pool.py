"""The pool's and the pool client's configuration (docs/configuration.md, generated from the
field docstrings here).

Unknown keys and wrong types are errors (`eagle_ray.config.loader`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from eagle_ray.config.loader import ConfigError, nested_from_dicts


@dataclasses.dataclass
class AutoscalingConfig:
    """Replicas follow demand (docs/architecture.md, "Autoscaling"); the keys follow Ray Serve's
    `autoscaling_config`. Demand is tokens leased or waiting for a lease."""

    min_replicas: int = 1
    """Fewest replicas the controller keeps (0: none while there is no demand)."""
    max_replicas: int = 4
    """Most replicas the controller starts."""
    target_outstanding_tokens_per_replica: int = 8192
    """Add replicas while demand per replica (ready or still starting) stays above this; remove
    them while it stays below (demand: tokens leased or waiting for a lease)."""
    upscale_delay_s: float = 30.0
    """Demand must stay above the target this long before a replica is added."""
    downscale_delay_s: float = 600.0
    """... and below it this long before one is removed (drained first)."""
    interval_s: float = 1.0
    """How often the controller reads demand and decides."""

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
    """What `TargetPool` builds (`target.*` of a job)."""

    model_path: str | None = None
    """Target checkpoint folder (HF format, safetensors); None: the tiny built-in target
    (`builtin_target`)."""
    builtin_target: Literal["llama", "qwen2_5_vl"] = "llama"
    """The tiny target built (pre-trained on the kit's generated chats, cached) where
    `model_path` is None: the text kit's Llama (`eagle_ray.tiny`), or a Qwen2.5-VL-shaped
    vision-language target pre-trained on generated image chats (`eagle_ray.tiny.vision`,
    `examples/tiny-vl.yaml`)."""
    backend: str = "vllm"
    """`vllm`, `hf`, or `package.module:factory` (`factory(config) -> backend`)."""
    replicas: int = 1
    """Replicas started with the pool."""
    tp_size: int = 1
    """Tensor-parallel ranks per replica, all on one node: the replica's one bundle holds
    `tp_size` GPUs (and `tp_size` x `cpus_per_bundle` CPUs), and vLLM runs its ranks as the
    replica's own worker processes (docs/architecture.md, "Tensor parallelism"). The `hf`
    backend takes 1."""
    dtype: str = "auto"
    """`auto`, `bfloat16`, `float16` or `float32`."""
    aux_layer_ids: list[int] | None = None
    """Canonical (post-layer) aux ids, one or more (an EAGLE-3 job needs three); None:
    `[1, N//2-1, N-4]` (docs/contract.md)."""
    encoding: Literal["last_hidden", "logits"] = "last_hidden"
    """What a replica returns besides the aux states: the last hidden state (the trainer applies
    the target's head) or logits."""
    encoding_dtype: Literal["auto", "fp8"] = "auto"
    """How hidden states travel: `auto` in the engine's dtype, `fp8` as float8 e4m3 with a scale
    per token and layer (half of bf16's bytes; the client dequantises; docs/contract.md)."""
    vllm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed to `vllm.LLM` untouched (over the small-machine defaults); a job's own pool gets
    `max_model_len` from the job unless set here."""
    backend_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of the backend's `from_pretrained` / factory."""
    use_gpu: bool = False
    """A replica asks for one GPU per TP rank (in its placement group's one bundle)."""
    cpus_per_bundle: float = 1.0
    """CPUs per TP rank (on CPU clusters: the engine's threads)."""
    bundle_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """Custom resources per TP rank, e.g. `{target_gpu: 1}` (the locality plan's node
    resources, docs/architecture.md)."""
    runtime_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Ray runtime env of the replicas."""
    name: str = "eagle_ray_pool"
    """Actor names: `<name>-router`, `<name>-replica-<i>`, `<name>-controller`."""
    namespace: str = "eagle_ray"
    """Ray namespace of the pool's actors."""
    detached: bool = False
    """Outlive the job that created the pool (`eagle-ray serve` sets it)."""
    router_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """Custom resources of the router actor (it takes no CPU), e.g. `{head: 0.001}` to keep it on
    the head node, off workers an autoscaler may reclaim."""
    max_outstanding_tokens_per_replica: int = 16384
    """Router backpressure: at most this many tokens outstanding on one replica."""
    lease_grace_s: float = 30.0
    """The router takes back a lease its client left unreported past the lease's term (the
    client's `timeout_s` plus `lease_reuse_s`) plus this long (a dead client's go back within
    seconds whatever this is). A client back from a longer stall (a GC pause, a checkpoint
    write, a stopped process) re-runs what it had on such leases and uses no grant older than
    `lease_reuse_s` plus this: it must read its grants within that (docs/architecture.md,
    "Reliability")."""
    replica_concurrency: int = 4
    """Calls a replica accepts at once (a call carries one micro-batch or several; all are merged
    into shared engine calls); 1: one call at a time."""
    max_tokens_per_engine_call: int = 16384
    """Padded slots (rows x longest row) of one merged engine call; a larger micro-batch runs
    alone. Also sizes the vLLM hand-off's shared-memory ring (two calls' captured states)."""
    replica_class: str = "eagle_ray.pool.replica:TargetReplica"
    """The replica actor, `module:Class`: the pool's own (a target backend behind its engine
    queue), or a class that answers the same calls (`ready`, `generate_many`) without an engine,
    as `eagle-ray bench scale`'s light replicas do (64 of them on one small machine)."""
    replica_pipeline: bool = True
    """The engine thread runs only the engine while a second thread turns the previous call's
    output into supervision (shift, encoding, fp8); False: one thread does both in turn (the
    benchmark's baseline, `eagle-ray bench replica`)."""
    locality: bool = True
    """Lease a replica on the client's own node while it has room (its results then stay in that
    node's shared memory instead of crossing the network; docs/architecture.md)."""
    autoscaling: AutoscalingConfig | None = None
    """Replicas follow demand (`AutoscalingConfig`, a mapping in YAML or Python); None:
    `replicas` stays fixed. Set, the pool starts `min_replicas` (or `replicas`, if larger and
    within bounds) and a controller adds and removes replicas."""
    ready_timeout_s: float = 600.0
    """How long `create` waits for the replicas (a replica that cannot build its backend fails
    it at once)."""

    def __post_init__(self) -> None:
        nested_from_dicts(self)
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {self.replicas}")
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.max_outstanding_tokens_per_replica < 1:
            raise ConfigError("max_outstanding_tokens_per_replica must be >= 1")
        if self.lease_grace_s <= 0:
            raise ConfigError(f"lease_grace_s must be > 0, got {self.lease_grace_s}")
        if self.replica_concurrency < 1 or self.max_tokens_per_engine_call < 1:
            raise ConfigError("replica_concurrency and max_tokens_per_engine_call must be >= 1")
        if ":" not in self.replica_class:
            raise ConfigError(f"replica_class must be 'module:Class', got {self.replica_class!r}")
        from eagle_ray.backends.engines import ENGINES

        engine = ENGINES.get(self.backend)
        if engine is None and ":" not in self.backend:
            raise ConfigError(f"backend must be one of {sorted(ENGINES)} or 'module:factory', "
                              f"got {self.backend!r}")
        if engine is not None:
            try:
                engine.check_config(self)
            except ValueError as e:
                raise ConfigError(f"target.{e}") from None

    # Every name the pool gives its actors and placement groups comes from here.

    @property
    def takes_images(self) -> bool:
        """Whether the target is a vision-language model, as far as the config can tell
        before anything loads: the built-in one chosen, or a local checkpoint whose
        `config.json` has a vision tower and an image token (a hub id: False until loaded)."""
        if self.model_path is None:
            return self.builtin_target != "llama"
        config = Path(self.model_path) / "config.json"
        if not config.is_file():
            return False
        # The keys `contract.checkpoint.is_vision_language` reads (without importing
        # transformers into every config load).
        fields = json.loads(config.read_text())
        return bool(fields.get("vision_config")) and fields.get("image_token_id") is not None

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

    max_inflight_micro_batches: int = 8
    """Micro-batches submitted but not yet consumed (backpressure: the client's window)."""
    max_inflight_tokens: int = 65536
    """Tokens submitted but not yet consumed."""
    timeout_s: float = 600.0
    """One attempt on one replica; then it is re-run elsewhere."""
    max_attempts: int = 4
    """Attempts of one micro-batch before the client raises."""
    lease_timeout_s: float = 600.0
    """Waiting for any replica to accept a micro-batch (also how long `connect` waits for a
    restarting router)."""
    lease_reuse_s: float = 5.0
    """A granted lease passes from a finished micro-batch to the next waiting one without a
    router call for this long, then goes back (so new, drained and restarted replicas are seen);
    0: one lease per micro-batch."""
    max_micro_batches_per_call: int = 8
    """Micro-batches leased on one replica at the same moment travel in one call (one Ray call
    each way instead of one per micro-batch; they merge on the engine anyway), up to this many,
    half the window and the replica's `max_tokens_per_engine_call`; 1: a call per
    micro-batch."""
