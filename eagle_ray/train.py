"""EAGLE-3 draft training on Ray Train, fed with supervision by the target pool: the driver.

`run_job` starts the pool (or joins a shared one started with `eagle-ray serve`) and checks that
what it serves is the target the job means, tokenises the chat data for that target, builds (or
reuses) the draft vocabulary, runs a `TorchTrainer` whose workers are `eagle_ray.train_loop`,
and evaluates the exported draft. With `data.supervision_cache` it starts no pool and reads no
data: the cache (`eagle_ray.supervision_cache`) holds the supervision, the draft vocabulary and
the held-out conversations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from eagle_ray.config import ClientConfig, ConfigError, JobConfig
from eagle_ray.identity import TargetIdentity
from eagle_ray.report import write_report_png
from eagle_ray.run_record import check_resumable, check_resumed_target, run_record
from eagle_ray.serving import DraftServing
from eagle_ray.supervision_cache import SupervisionCache
from eagle_ray.tokenizer_files import check_tokenizer, load_tokenizer
from eagle_ray.train_loop import SETUP_KEY, WorkerSetup, train_loop_per_worker

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the driver


def check_job_memory(config: JobConfig) -> None:
    """A GPU job whose trainer worker or replica would not fit its GPU (`eagle-ray plan`, on
    the driver's GPU or `train.gpu_memory_gib`, else an assumed 80 GiB that each worker checks
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
    from eagle_ray.ingest import prepare_job_data
    from eagle_ray.resources import check_job_resources
    from eagle_ray.trackers import check_loggers

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
        from eagle_ray.evaluate import evaluate_on_cluster, evaluation_prompts

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
    from eagle_ray.ingest import JobData

    vocab = cache.draft_vocab
    if vocab.size != config.data.draft_vocab_size:
        raise ConfigError(f"the supervision cache {cache.path} was written with a draft "
                          f"vocabulary of {vocab.size} tokens, the job asks for "
                          f"data.draft_vocab_size={config.data.draft_vocab_size}; set it to "
                          f"{vocab.size} or write the cache again")
    return JobData(None, cache.index["held_out"], vocab, cache.index["statuses"], None,
                   len(cache) / config.train.workers)


@contextlib.contextmanager
def job_pool(config: JobConfig) -> Iterator[tuple[Any, TargetIdentity]]:
    """The job's pool and what it serves, checked against the job's target settings: started
    for the job (and shut down after it, its engines sized for the job's longest sequence), or
    the shared one named `target.name` (refused when its engines take shorter rows)."""
    from eagle_ray.engine_sizing import check_rows_fit, sized_pool_config
    from eagle_ray.identity import check_job_target
    from eagle_ray.pool import TargetPool

    owned = None if config.use_shared_pool else TargetPool.create(sized_pool_config(config))
    try:
        pool = owned or TargetPool.connect(config.target.name, config.target.namespace)
        served = pool.identity(config.target.ready_timeout_s)
        check_job_target(config.target, served)
        if owned is None:
            check_rows_fit(config, served.max_length)
        logger.info("the pool serves %s", served.describe())
        yield pool, served
    finally:
        if owned is not None:
            owned.shutdown()


def check_eval(config: JobConfig) -> None:
    """The evaluation's settings and prompts file, checked before anything starts."""
    if config.eval.enabled:
        from eagle_ray.evaluate import check_eval_settings, evaluation_prompts

        check_eval_settings(config.eval, config.train.ttt_steps)
        if config.eval.prompts_file:
            evaluation_prompts(config.eval)


def draft_serving(config: JobConfig, model_path: str, draft_dir: Path) -> DraftServing:
    """How vLLM serves the job's draft, evaluated and printed alike: the target's dtype and
    tensor-parallel size, and a tokenizer kept elsewhere (`target.vllm_kwargs.tokenizer`)."""
    return DraftServing.for_target(model_path, draft_dir, config.target.dtype,
                                   config.target.tp_size,
                                   config.target.vllm_kwargs.get("tokenizer"))


def check_paths(config: JobConfig) -> None:
    """Fail before any cluster work when an input path is wrong."""
    model_path = config.target.model_path
    if model_path is not None and not (Path(model_path) / "config.json").exists():
        raise ConfigError(f"target.model_path {model_path!r} is not a model folder (no "
                          f"config.json); pass a local HF checkpoint, or null for the tiny "
                          f"built-in target")
    if model_path is not None:
        check_tokenizer(model_path, config.target.vllm_kwargs,
                        "the job (it renders the chat data)")
        check_aux_layer_ids(config)
    paths = [config.data.path] if isinstance(config.data.path, str) else config.data.path or []
    missing = [p for p in paths if not Path(p).exists()]
    if missing and config.regenerate.enabled:
        raise ConfigError(f"data.path {missing} does not exist here; the driver reads it to "
                          f"regenerate its answers: pass chat JSONL or JSON files the driver "
                          f"sees (docs/operations.md, \"Storage\")")


def check_data_on_the_cluster(config: JobConfig) -> None:
    """`data.path` entries the driver does not see are fine when every node that runs Ray Data's
    readers (nodes with CPUs) sees them: only those read the data (docs/operations.md,
    "Storage")."""
    paths = [config.data.path] if isinstance(config.data.path, str) else config.data.path or []
    missing = [p for p in paths if not Path(p).exists()]
    if not missing:
        return
    from eagle_ray.preflight import paths_missing_on_readers

    unseen = paths_missing_on_readers(missing)
    if unseen:
        raise ConfigError(f"data.path {sorted(unseen)} does not exist on "
                          f"{', '.join(sorted(set(sum(unseen.values(), []))))}; pass chat JSONL, "
                          f"JSON or Parquet files or folders (messages or ShareGPT "
                          f"conversations) on storage those nodes mount, or null for generated "
                          f"data")


def mask_token_id(config: JobConfig, tokenizer, served: TargetIdentity) -> int | None:
    """The mask token of a P-EAGLE or DFlash draft (None for a draft without one)."""
    from eagle_ray.draft.kinds import uses_mask_token

    if not uses_mask_token(config.draft.kind):
        return None
    from eagle_ray.draft.peagle import resolve_mask_token_id

    try:
        return resolve_mask_token_id(config.draft.mask_token_id, tokenizer, served.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_aux_layer_ids(config: JobConfig) -> None:
    """`target.aux_layer_ids` against the checkpoint's layers, before any engine starts: three
    for an EAGLE-3 draft, any number for the kinds that read N (P-EAGLE, DFlash)."""
    if config.target.aux_layer_ids is None:
        return
    from transformers import AutoConfig

    from eagle_ray.aux_layers import resolve_aux_layer_ids, resolve_eagle3_aux_layer_ids

    layers = AutoConfig.from_pretrained(config.target.model_path).get_text_config()
    resolve = (resolve_eagle3_aux_layer_ids if config.draft.kind == "eagle3"
               else resolve_aux_layer_ids)
    try:
        resolve(config.target.aux_layer_ids, layers.num_hidden_layers)
    except ValueError as e:
        raise ConfigError(f"target.aux_layer_ids {config.target.aux_layer_ids}: {e}") from None


def init_ray(config: JobConfig, log_to_driver: bool = True) -> None:
    """Join `ray_address` / RAY_ADDRESS / a running local cluster, or start a local one (with
    its dashboard: Ray Train's placement-group cleaner asks the state API about its controller,
    and without it warns on every poll)."""
    if ray.is_initialized():
        return
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        logger.info("Ray: joined %s", address)
        return
    try:
        ray.init(address="auto", log_to_driver=log_to_driver)
        logger.info("Ray: joined the running local cluster")
    except ConnectionError:
        # A laptop: a local cluster with room for the workers, the replicas (as many as the pool
        # may grow to) and the router.
        target = config.target
        replicas = target.autoscaling.max_replicas if target.autoscaling else target.replicas
        cpus = config.train.workers * config.train.cpus_per_worker + replicas * (
            target.cpus_per_bundle * target.tp_size) + 1
        ray.init(num_cpus=max(math.ceil(cpus), os.cpu_count() or 1),
                 object_store_memory=512 * 2**20, log_to_driver=log_to_driver)
        logger.info("Ray: started a local instance (%s CPUs)", ray.cluster_resources()["CPU"])
