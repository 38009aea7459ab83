"""The training job's configuration: `eagle-ray train --config FILE [key=value ...]`.

Every key is documented in the README ("Job config keys"); unknown keys and wrong types are errors
(`eagle_ray.config.loader`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from eagle_ray.config.pool import PoolConfig

# Defaults follow the public EAGLE-3 recipes for 8B-class targets (SpecForge: lr 1e-4, 7 TTT
# steps, grad norm 0.5, 2048 tokens, 32k draft vocabulary); examples/tiny.yaml sets the tiny
# target's own values.


@dataclasses.dataclass
class DataConfig:
    # Chat JSONL: {"messages": [{"role", "content"}]} or ShareGPT {"conversations": [{"from",
    # "value"}]} per line; None: the built-in generated chat data.
    path: str | None = None
    num_samples: int = 320  # generated data only
    max_length: int = 2048  # tokens per row (capped at what the target accepts)
    overlong: Literal["truncate", "drop"] = "truncate"  # rows over max_length (counted)
    micro_batch_size: int = 8
    draft_vocab_size: int = 32000  # = the target's vocabulary: a full-vocabulary draft
    eval_samples: int = 16  # the last N conversations are held out for evaluation


@dataclasses.dataclass
class TrainConfig:
    workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    # Custom resources per worker, e.g. {trainer_node: 1} to keep trainers off target GPUs.
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 200
    lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7
    prefetch: int = 4  # micro-batches each worker keeps in flight at the pool
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0
    intermediate_size: int | None = None  # draft MLP width; None: the target's
    # Ray Train's failure handling (FailureConfig), bounded so that a job that cannot run ends:
    max_failures: int = 0  # worker failures recovered from the latest checkpoint; -1: no limit
    max_controller_failures: int = 3  # worker-group start failures (e.g. never scheduled)


@dataclasses.dataclass
class EvalConfig:
    enabled: bool = True
    prompts: int = 8  # held-out prompts
    max_new_tokens: int = 32
    num_speculative_tokens: int = 3
    vllm: bool = True  # also measure acceptance with vLLM serving the exported draft


@dataclasses.dataclass
class JobConfig:
    """`eagle-ray train --config FILE [key=value ...]`; every key is in the README."""

    target: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    use_shared_pool: bool = False  # join a pool started with `eagle-ray serve` (target.name)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    output_dir: str = "runs/tiny"
    run_name: str = "eagle3-draft"
    storage_path: str | None = None  # Ray Train storage (shared storage on clusters)
    ray_address: str | None = None  # None: RAY_ADDRESS or a running local cluster, else a new one
