"""EAGLE-3 draft training on Ray Train, fed with supervision by the target pool.

The driver (`run_job`) tokenises the chat data, builds (or reuses) the draft vocabulary, starts
the pool (or joins a shared one started with `eagle-ray serve`), and runs a `TorchTrainer`. Each
worker streams its shard's micro-batches through a `PoolClient` -- the in-flight window prefetches
supervision, so target latency overlaps the draft's compute -- and trains with DDP, AdamW,
warm-up + cosine decay and gradient clipping; checkpoints go through `ray.train.Checkpoint` and a
rerun with the same `run_name` resumes. Rank 0 exports the draft in vLLM's EAGLE-3 layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from eagle_ray.config import ClientConfig, ConfigError, JobConfig, TrainConfig, from_dict, to_dict

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "draft_state.pt"


# ---------------------------------------------------------------------------- the driver


def run_job(config: JobConfig) -> dict[str, Any]:
    """Train, export and evaluate a draft; returns the summary written to `output_dir`."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from transformers import AutoTokenizer

    from eagle_ray.data import (
        load_or_build_draft_vocab,
        make_micro_batches,
        read_jsonl,
        tokenize_chats,
    )
    from eagle_ray.pool import TargetPool
    from eagle_ray.tiny import generate_chat_samples, tiny_target

    check_paths(config)
    output_dir = Path(config.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    target = dataclasses.replace(config.target,
                                 model_path=config.target.model_path or str(tiny_target("llama")))
    _init_ray(config)

    tokenizer = AutoTokenizer.from_pretrained(target.model_path)
    samples = (list(read_jsonl(config.data.path)) if config.data.path
               else generate_chat_samples(config.data.num_samples))
    held_out = samples[-config.data.eval_samples:] if config.data.eval_samples else []
    train_samples = samples[:len(samples) - len(held_out)]
    chats = tokenize_chats(train_samples, tokenizer, config.data.max_length)
    vocab = load_or_build_draft_vocab(output_dir / "draft_vocab.json", chats.rows,
                                      len(tokenizer), config.data.draft_vocab_size)
    micro_batches = make_micro_batches(chats.rows, config.data.micro_batch_size,
                                       tokenizer.pad_token_id or 0, config.train.seed)

    pool = None
    if config.use_shared_pool:
        TargetPool.connect(target.name, target.namespace)  # fails clearly when it is not there
    else:
        pool = TargetPool.create(target)
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "job": to_dict(config),
                "model_path": target.model_path,
                "pool": (target.name, target.namespace),
                "micro_batches": ray.put(micro_batches),
                "draft_to_target": vocab.draft_to_target.tolist(),
                "target_vocab_size": vocab.target_vocab_size,
                "output_dir": str(output_dir),
            },
            scaling_config=ScalingConfig(
                num_workers=config.train.workers, use_gpu=config.train.use_gpu,
                resources_per_worker={"CPU": config.train.cpus_per_worker,
                                      **({"GPU": 1} if config.train.use_gpu else {}),
                                      **config.train.worker_resources}),
            torch_config=TorchConfig(backend="nccl" if config.train.use_gpu else "gloo"),
            run_config=RunConfig(name=config.run_name, storage_path=config.storage_path
                                 or str(output_dir / "ray_results")),
        )
        result = trainer.fit()
    finally:
        if pool is not None:
            pool.shutdown()
    summary: dict[str, Any] = {
        "final_metrics": result.metrics,
        "draft_dir": str(output_dir / "draft"),
        "dropped_too_long": chats.dropped_too_long,
        "dropped_no_answer": chats.dropped_no_answer,
        "micro_batches": len(micro_batches),
    }
    if config.eval.enabled:
        from eagle_ray.evaluate import evaluate_draft

        summary["eval"] = evaluate_draft(target.model_path, output_dir / "draft", held_out,
                                         tokenizer, config.eval, target.aux_layer_ids)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info("summary: %s", json.dumps(summary, default=str))
    return summary


def check_paths(config: JobConfig) -> None:
    """Fail before any cluster work when an input path is wrong."""
    model_path = config.target.model_path
    if model_path is not None and not (Path(model_path) / "config.json").exists():
        raise ConfigError(f"target.model_path {model_path!r} is not a model folder (no "
                          f"config.json); pass a local HF checkpoint, or null for the tiny "
                          f"built-in target")
    if config.data.path is not None and not Path(config.data.path).is_file():
        raise ConfigError(f"data.path {config.data.path!r} does not exist; pass a chat JSONL "
                          f"file, or null for generated data")


def _init_ray(config: JobConfig) -> None:
    if ray.is_initialized():
        return
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        # A laptop: a local cluster with room for the workers, the replicas and the router.
        cpus = config.train.workers * config.train.cpus_per_worker + config.target.replicas * (
            config.target.cpus_per_bundle * config.target.tp_size) + 1
        ray.init(num_cpus=max(math.ceil(cpus), os.cpu_count() or 1),
                 object_store_memory=512 * 2**20, include_dashboard=False)


# ---------------------------------------------------------------------------- the workers


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: stream supervision from the pool, train the draft with DDP."""
    import ray.train
    import ray.train.torch
    from tqdm import tqdm
    from transformers import AutoConfig

    from eagle_ray.aux_layers import resolve_eagle3_aux_layer_ids
    from eagle_ray.checkpoint import load_embedding_and_head
    from eagle_ray.draft.export import export_draft
    from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss
    from eagle_ray.pool import PoolClient
    from eagle_ray.supervision import DraftVocab, draft_target

    job = from_dict(JobConfig, loop_config["job"])
    train = job.train
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(train.seed)
    device = ray.train.torch.get_device()

    target_config = AutoConfig.from_pretrained(loop_config["model_path"])
    num_layers = target_config.get_text_config().num_hidden_layers
    embedding, head = load_embedding_and_head(loop_config["model_path"], torch.float32)
    head = head.to(device)
    vocab = DraftVocab(torch.tensor(loop_config["draft_to_target"]),
                       loop_config["target_vocab_size"])
    draft = Eagle3Draft(DraftConfig.from_target(target_config, vocab.size,
                                                train.intermediate_size), embedding.weight)
    model = ray.train.torch.prepare_model(draft)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(train))

    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            state = torch.load(Path(ckpt_dir) / CHECKPOINT_FILE, weights_only=False)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
        logger.info("worker %d resumes at step %d", rank, start_step)

    micro_batches = ray.get(loop_config["micro_batches"])[rank::world]
    client = PoolClient.connect(*loop_config["pool"],
                                ClientConfig(max_inflight_micro_batches=train.prefetch))

    def my_micro_batches():
        for step in range(start_step, train.steps):
            yield micro_batches[step % len(micro_batches)]

    metrics_path = Path(loop_config["output_dir"]) / "metrics.jsonl"
    progress = tqdm(total=train.steps, initial=start_step, disable=rank != 0, desc="draft",
                    unit="step")
    # Logged metrics average over the steps since the last log (single steps are noisy).
    window_start, window_tokens, window_wait = time.perf_counter(), 0, 0.0
    window_sums: dict[str, float] = {}
    window_steps = 0
    supervision = client.stream(my_micro_batches())
    for step in range(start_step, train.steps):
        waited = time.perf_counter()
        batch = next(supervision).to(device)
        window_wait += time.perf_counter() - waited
        probs, position_mask = draft_target(batch, vocab, head)
        loss, step_losses, step_accuracies = ttt_loss(
            model, batch.aux_hidden_states.float(), batch.input_ids, batch.attention_mask,
            batch.loss_mask, probs, position_mask, train.ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        optimizer.step()
        scheduler.step()
        window_tokens += int(batch.attention_mask.sum())
        window_steps += 1
        values = {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}
        values.update({f"loss_{k}": v for k, v in enumerate(step_losses)})
        values.update({f"acc_{k}": v for k, v in enumerate(step_accuracies)})
        for name, value in values.items():
            window_sums[name] = window_sums.get(name, 0.0) + value
        progress.update(1)
        done = step + 1
        if done % train.log_every and done % train.checkpoint_every and done != train.steps:
            continue
        elapsed = time.perf_counter() - window_start
        metrics = {"step": done, "lr": scheduler.get_last_lr()[0],
                   **{name: total / window_steps for name, total in window_sums.items()},
                   "supervision_tokens_per_s": window_tokens * world / max(elapsed, 1e-9),
                   "pool_wait_share": window_wait / max(elapsed, 1e-9)}
        window_start, window_tokens, window_wait = time.perf_counter(), 0, 0.0
        window_sums, window_steps = {}, 0
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}")
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if done % train.checkpoint_every == 0 or done == train.steps:
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": done},
                               Path(tmp) / CHECKPOINT_FILE)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp)
                                 if rank == 0 else None)
        else:
            ray.train.report(metrics)
    progress.close()
    if rank == 0:
        aux_ids = resolve_eagle3_aux_layer_ids(job.target.aux_layer_ids, num_layers)
        export_draft(draft, vocab, aux_ids, num_layers, Path(loop_config["output_dir"]) / "draft")


def _warmup_cosine(train: TrainConfig):
    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor
