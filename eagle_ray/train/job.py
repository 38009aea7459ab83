"""`eagle-ray train`: draft training on Ray Train, fed with supervision by the target pool.

`run_job` starts the pool (or joins a shared one started with `eagle-ray serve`; both through
`eagle_ray.driver`) and checks that what it serves is the target the job means, tokenises the
chat data for that target, builds (or reuses) the draft vocabulary, runs a `TorchTrainer` whose
workers are `eagle_ray.train.loop`, and evaluates the exported draft. With
`data.supervision_cache` it starts no pool and reads no data: the cache
(`eagle_ray.data.supervision_cache`) holds the supervision, the draft vocabulary and the
held-out conversations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from eagle_ray.config import ClientConfig, ConfigError, JobConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.data.supervision_cache import SupervisionCache
from eagle_ray.data.tokenizer_files import load_tokenizer
from eagle_ray.driver import (
    check_data_on_the_cluster,
    check_eval,
    check_paths,
    draft_serving,
    init_ray,
    job_pool,
)
from eagle_ray.train.loop import SETUP_KEY, WorkerSetup, train_loop_per_worker
from eagle_ray.train.report import write_report_png
from eagle_ray.train.run_record import check_resumable, check_resumed_target, run_record

logger = logging.getLogger(__name__)


def check_job_memory(config: JobConfig) -> None:
    """A GPU job whose trainer worker or replica would not fit its GPU (`eagle-ray plan`, on
    the driver's GPU, else `train.gpu_memory_gib`, else an assumed 80 GiB; each worker checks
    again on its own GPU) stops here, naming the keys to change, before Ray or a pool
    starts."""
    if not (config.train.use_gpu and config.target.model_path):
        return
    from transformers import AutoConfig

    from eagle_ray.plan import check_job_fits, plan_job

    plan = plan_job(config, AutoConfig.from_pretrained(config.target.model_path))
    logger.info("plan: a trainer worker needs %.1f GiB and a replica %.1f GiB per GPU of %.0f "
                "GiB (%s)", plan.trainer["total"] / 2**30, plan.replica["total"] / 2**30,
                plan.assumptions["gpu_memory_gib"], plan.assumptions["gpu_memory_from"])
    check_job_fits(config, plan)


def run_job(config: JobConfig, log_to_driver: bool = True) -> dict[str, Any]:
    """Train, export and evaluate a draft; returns the summary written to `output_dir` (also
    `report.png` there). `log_to_driver=False` keeps the Ray workers' output (engines, Ray
    Train) off this process's console (`eagle_ray.console`).

    Order matters: the pool comes first, because what it serves (checkpoint, layers, vocabulary,
    longest row) decides how the data is tokenised and what the export says.
    """
    from eagle_ray.console import ProgressBoard, TrainingBar
    from eagle_ray.data.ingest import prepare_job_data
    from eagle_ray.resources import check_job_resources
    from eagle_ray.train.trackers import check_loggers

    check_paths(config)
    check_job_memory(config)
    check_loggers(config.train.loggers)
    check_eval(config)
    resumed = check_resumable(config)
    output_dir = Path(config.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    cache = SupervisionCache.open(config.data.supervision_cache) \
        if config.data.supervision_cache else None
    init_ray(config, log_to_driver)
    check_data_on_the_cluster(config)
    check_job_resources(config, with_pool=cache is None)

    with job_supervision(config, cache) as (pool, served):
        check_resumed_target(resumed, served)
        # A path the job names (its own mount of the same checkpoint) wins over the pool's.
        model_path = config.target.model_path or served.model_path
        tokenizer_at, tokenizer = load_tokenizer(model_path, config.target.vllm_kwargs,
                                                 "the job (it renders the chat data)")
        data = cached_job_data(config, cache) if cache else prepare_job_data(
            config, served, tokenizer_at, tokenizer,
            pool.client(ClientConfig(max_inflight_micro_batches=16)), output_dir)
        config = with_steps_from_epochs(config, data.micro_batches_per_epoch)
        board = ProgressBoard.remote()
        trainer = torch_trainer(config, data, output_dir, WorkerSetup(
            job=config, model_path=model_path, served=served,
            draft_to_target=data.vocab.draft_to_target.tolist(),
            pad_id=tokenizer.pad_token_id or 0, output_dir=str(output_dir),
            run_record=run_record(config, served),
            mask_token_id=mask_token_id(config, tokenizer, served), progress=board))
        logger.info("training: %d Ray Train workers, %d steps", config.train.workers,
                    config.train.steps)
        with TrainingBar(board, config.train.steps, start=resumed.step if resumed else 0):
            result = trainer.fit()
        ray.kill(board)
    logger.info("draft exported to %s", output_dir / "draft")
    return write_summary(config, result.metrics, data, served, model_path, output_dir)


def with_steps_from_epochs(config: JobConfig, micro_batches_per_epoch: float | None
                           ) -> JobConfig:
    """`config` with `train.steps` from `train.epochs` (each worker's micro-batches in one pass
    over the training rows, times the epochs); unchanged when steps were given."""
    train = config.train
    if train.epochs is None:
        return config
    steps = max(1, math.ceil(train.epochs * (micro_batches_per_epoch or 0)))
    logger.info("train.epochs %g: %d steps (%.1f micro-batches per worker and epoch)",
                train.epochs, steps, micro_batches_per_epoch or 0)
    return dataclasses.replace(config, train=dataclasses.replace(train, steps=steps, epochs=None))


def torch_trainer(config: JobConfig, data, output_dir: Path, setup: WorkerSetup):
    """Ray Train's `TorchTrainer` for the job: its workers, resources, storage and failure
    handling (bounded, so a worker group that cannot start ends the job)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    train = config.train
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={SETUP_KEY: setup},
        datasets={"train": data.train} if data.train is not None else None,
        scaling_config=ScalingConfig(
            num_workers=train.workers, use_gpu=train.use_gpu,
            resources_per_worker={"CPU": train.cpus_per_worker,
                                  **({"GPU": 1} if train.use_gpu else {}),
                                  **train.worker_resources}),
        torch_config=TorchConfig(backend="nccl" if train.use_gpu else "gloo"),
        run_config=RunConfig(
            name=config.run_name,
            storage_path=config.storage_path or str(output_dir / "ray_results"),
            failure_config=FailureConfig(max_failures=train.max_failures,
                                         controller_failure_limit=train.max_controller_failures)),
    )


def write_summary(config: JobConfig, final_metrics: dict[str, Any], data, served: TargetIdentity,
                  model_path: str, output_dir: Path) -> dict[str, Any]:
    """Evaluate the exported draft (a Ray task where the target's GPUs are: the driver loads no
    model), then write `summary.json` and `report.png`."""
    serving = draft_serving(config, model_path, output_dir / "draft")
    summary: dict[str, Any] = {
        "run_name": config.run_name,
        "final_metrics": final_metrics,
        "draft_dir": str(output_dir / "draft"),
        "draft_kind": config.draft.kind,
        "target": served.to_dict(),
        "data": data.statuses,
        **({"regenerated": data.regenerated} if data.regenerated else {}),
    }
    if config.eval.enabled:
        from eagle_ray.evaluation.evaluate import evaluate_on_cluster, evaluation_prompts

        summary["eval"] = evaluate_on_cluster(
            config.target, serving, evaluation_prompts(config.eval, data.held_out), config.eval)
    summary["serve_command"] = serving.command(config.eval.num_speculative_tokens[0])
    summary["report"] = str(write_report_png(summary, read_metrics(output_dir),
                                             output_dir / "report.png"))
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.debug("summary: %s", json.dumps(summary, default=str))
    return summary


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The run's logged metrics (`metrics.jsonl`, one object per log window)."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@contextlib.contextmanager
def job_supervision(config: JobConfig, cache: SupervisionCache | None
                    ) -> Iterator[tuple[Any, TargetIdentity]]:
    """`(pool, what it serves)` from `job_pool`, or `(None, what made the cache)` when the job
    reads a supervision cache (checked against the job's target settings)."""
    if cache is None:
        with job_pool(config) as pool_and_served:
            yield pool_and_served
        return
    cache.check_target(config.target)
    logger.info("supervision from the cache %s (%d micro-batches, %d tokens), made by %s",
                cache.path, len(cache), cache.index["tokens"], cache.identity.describe())
    yield None, cache.identity


def cached_job_data(config: JobConfig, cache: SupervisionCache):
    """What the job trains on and evaluates with, from the cache (no data is read)."""
    from eagle_ray.data.ingest import JobData

    vocab = cache.draft_vocab
    if vocab.size != config.data.draft_vocab_size:
        raise ConfigError(f"the supervision cache {cache.path} was written with a draft "
                          f"vocabulary of {vocab.size} tokens, the job asks for "
                          f"data.draft_vocab_size={config.data.draft_vocab_size}; set it to "
                          f"{vocab.size} or write the cache again")
    return JobData(None, cache.index["held_out"], vocab, cache.index["statuses"], None,
                   len(cache) / config.train.workers)


def mask_token_id(config: JobConfig, tokenizer, served: TargetIdentity) -> int | None:
    """The mask token of a P-EAGLE or DFlash draft (None for a draft without one)."""
    from eagle_ray.draft.kinds import draft_class

    if not draft_class(config.draft.kind).reads_mask_token:
        return None
    from eagle_ray.draft.peagle import resolve_mask_token_id

    try:
        return resolve_mask_token_id(config.draft.mask_token_id, tokenizer, served.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


