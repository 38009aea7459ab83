"""What every job's driver does before and around its work (`eagle-ray train`, `cache`, `eval`):
join or start Ray, check the job's paths and settings before any cluster work, and hold the
job's pool (started for the job, or the shared one) for as long as the job needs it.

The driver runs on the head, which may have no GPU and no copy of the data: nothing here loads a
model (tests/train/test_train.py watches for it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from eagle_ray.config import ConfigError, JobConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.data.tokenizer_files import check_tokenizer
from eagle_ray.draft.serving import DraftServing

logger = logging.getLogger(__name__)


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


def check_aux_layer_ids(config: JobConfig) -> None:
    """`target.aux_layer_ids` against the checkpoint's layers, before any engine starts: three
    for an EAGLE-3 draft, any number for the kinds that read N (P-EAGLE, DFlash)."""
    if config.target.aux_layer_ids is None:
        return
    from transformers import AutoConfig

    from eagle_ray.contract.aux_layers import resolve_aux_layer_ids, resolve_eagle3_aux_layer_ids
    from eagle_ray.draft.kinds import draft_class

    layers = AutoConfig.from_pretrained(config.target.model_path).get_text_config()
    resolve = (resolve_eagle3_aux_layer_ids if draft_class(config.draft.kind).eagle3_aux_layers
               else resolve_aux_layer_ids)
    try:
        resolve(config.target.aux_layer_ids, layers.num_hidden_layers)
    except ValueError as e:
        raise ConfigError(f"target.aux_layer_ids {config.target.aux_layer_ids}: {e}") from None


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


def check_eval(config: JobConfig) -> None:
    """The evaluation's settings and prompts file, checked before anything starts."""
    if config.eval.enabled:
        from eagle_ray.evaluation.evaluate import check_eval_settings, evaluation_prompts

        check_eval_settings(config.eval, config.train.ttt_steps)
        if config.eval.prompts_file:
            evaluation_prompts(config.eval)


@contextlib.contextmanager
def job_pool(config: JobConfig) -> Iterator[tuple[Any, TargetIdentity]]:
    """The job's pool and what it serves, checked against the job's target settings: started
    for the job (and shut down after it, its engines sized for the job's longest sequence), or
    the shared one named `target.name` (refused when its engines take shorter rows)."""
    from eagle_ray.backends.sizing import check_rows_fit, sized_pool_config
    from eagle_ray.contract.identity import check_job_target
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


def draft_serving(config: JobConfig, model_path: str, draft_dir: Path) -> DraftServing:
    """How vLLM serves the job's draft, evaluated and printed alike: the target's dtype and
    tensor-parallel size, and a tokenizer kept elsewhere (`target.vllm_kwargs.tokenizer`)."""
    return DraftServing.for_target(model_path, draft_dir, config.target.dtype,
                                   config.target.tp_size,
                                   config.target.vllm_kwargs.get("tokenizer"))
