"""One Ray Train worker of the draft-training job (`eagle_ray.train.run_job` starts them).

Each worker streams its shard's micro-batches through a `PoolClient` -- the in-flight window
prefetches supervision, so target latency overlaps the draft's compute -- and trains with DDP,
AdamW, warm-up + cosine decay and gradient clipping; checkpoints go through
`ray.train.Checkpoint`, and a rerun with the same `run_name` resumes. Rank 0 exports the draft
for the target the pool served.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eagle_ray.checkpoint import load_embedding_and_head
from eagle_ray.config import ClientConfig, DataConfig, JobConfig, TrainConfig, from_dict
from eagle_ray.data import padding_share, token_budget_micro_batches
from eagle_ray.draft.export import export_draft
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss
from eagle_ray.identity import TargetIdentity
from eagle_ray.pool import PoolClient
from eagle_ray.pool.telemetry import TrainerMetrics
from eagle_ray.run_record import RECORD_FILE
from eagle_ray.supervision import DraftVocab, draft_target
from eagle_ray.supervision_cache import SupervisionCache
from eagle_ray.trackers import Trackers
from eagle_ray.train_device import DevicePrefetcher, autocast_dtype

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "draft_state.pt"


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: stream supervision from the pool, train the draft with DDP."""
    import ray.train
    import ray.train.torch
    from transformers import AutoConfig

    job = from_dict(JobConfig, loop_config["job"])
    train = job.train
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(train.seed)
    device = ray.train.torch.get_device()
    precision = autocast_dtype(train.precision, device)  # None: fp32 throughout
    if device.type == "cuda":  # fp32 matmuls (fp32 precision, or what autocast leaves) use TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    served = TargetIdentity.from_dict(loop_config["target"])
    target_config = AutoConfig.from_pretrained(loop_config["model_path"])
    embedding, head = load_embedding_and_head(loop_config["model_path"], torch.float32)
    head = head.to(device)
    vocab = DraftVocab(torch.tensor(loop_config["draft_to_target"]), served.vocab_size)
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

    if job.data.supervision_cache:
        # Supervision read from disk: the time spent reading counts as waiting for data.
        micro_batches = TimedIterator(SupervisionCache.open(job.data.supervision_cache).stream(
            rank, world, train.seed + start_step))
        supervision = micro_batches
    else:
        client = PoolClient.connect(job.target.name, job.target.namespace,
                                    ClientConfig(max_inflight_micro_batches=train.prefetch))
        micro_batches = TimedIterator(itertools.islice(
            shard_micro_batches(ray.train.get_dataset_shard("train"), job,
                                loop_config["pad_id"], rank), train.steps - start_step))
        supervision = client.stream(micro_batches)
    on_device = DevicePrefetcher(supervision, device)

    metrics_path = Path(loop_config["output_dir"]) / "metrics.jsonl"
    # Rank 0 reports: the driver's progress bar (`console.ProgressBoard`) and the trackers.
    board = loop_config.get("progress") if rank == 0 else None
    trackers = Trackers(train.loggers, Path(loop_config["output_dir"]), job.run_name,
                        loop_config["job"], train.mlflow_tracking_uri, train.mlflow_experiment
                        ) if rank == 0 and train.loggers else None
    telemetry = TrainerMetrics(job.run_name, rank)  # every worker, for Prometheus / Grafana
    # Logged metrics average over the steps since the last log (single steps are noisy).
    window_start, window_tokens, window_wait = time.perf_counter(), 0, 0.0
    window_data_wait = micro_batches.seconds
    # Sums over the window stay on the device (one host sync per log, not per step); host-side
    # statistics are read from the host batch.
    window_sums: dict[str, torch.Tensor] = {}
    window_padding, window_steps = 0.0, 0
    for step in range(start_step, train.steps):
        waited = time.perf_counter()
        host_batch, batch = next(on_device)
        window_wait += time.perf_counter() - waited
        window_padding += padding_share(
            (host_batch.input_ids, host_batch.attention_mask, host_batch.loss_mask))
        window_tokens += int(host_batch.attention_mask.sum())
        probs, position_mask = draft_target(batch, vocab, head)
        with (torch.autocast(device.type, dtype=precision) if precision
              else contextlib.nullcontext()):
            loss, step_losses, step_accuracies = ttt_loss(
                model, batch.aux_hidden_states, batch.input_ids, batch.loss_mask, probs,
                position_mask, train.ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        optimizer.step()
        scheduler.step()
        window_steps += 1
        values = {"loss": loss.detach(), "grad_norm": grad_norm,
                  **{f"loss_{k}": v for k, v in enumerate(step_losses)},
                  **{f"acc_{k}": v for k, v in enumerate(step_accuracies)}}
        for name, value in values.items():
            window_sums[name] = window_sums[name] + value if name in window_sums else value
        done = step + 1
        if done % train.log_every and done % train.checkpoint_every and done != train.steps:
            if board is not None:
                board.post.remote(done)
            continue
        elapsed = time.perf_counter() - window_start
        data_wait = micro_batches.seconds - window_data_wait
        names = list(window_sums)
        means = (torch.stack([window_sums[n].float() for n in names]) / window_steps).tolist()
        metrics = {"step": done, "lr": scheduler.get_last_lr()[0],
                   **dict(zip(names, means, strict=True)),
                   "padding_share": window_padding / window_steps,
                   "supervision_tokens_per_s": window_tokens * world / max(elapsed, 1e-9),
                   # Waiting for supervision includes reading the data (the client pulls the
                   # next micro-batch when it has room): report the two apart.
                   "pool_wait_share": max(window_wait - data_wait, 0.0) / max(elapsed, 1e-9),
                   "data_wait_share": data_wait / max(elapsed, 1e-9)}
        telemetry.report(window_tokens / max(elapsed, 1e-9), metrics["pool_wait_share"])
        window_start, window_tokens, window_wait = time.perf_counter(), 0, 0.0
        window_data_wait = micro_batches.seconds
        window_sums, window_padding, window_steps = {}, 0.0, 0
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if board is not None:
                board.post.remote(done, metrics)
            if trackers is not None:
                trackers.log(metrics, done)
        if done % train.checkpoint_every == 0 or done == train.steps:
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": done},
                               Path(tmp) / CHECKPOINT_FILE)
                    (Path(tmp) / RECORD_FILE).write_text(json.dumps(loop_config["run_record"]))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp)
                                 if rank == 0 else None)
        else:
            ray.train.report(metrics)
    if trackers is not None:
        trackers.close()
    if rank == 0:
        export_draft(draft, vocab, served, Path(loop_config["output_dir"]) / "draft",
                     train.ttt_steps)


def shard_micro_batches(shard, job: JobConfig, pad_id: int, rank: int
                        ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This worker's shard of the training rows as token-budget micro-batches, epoch after
    epoch (each epoch's row order and packing seeded by the epoch), for as long as asked."""
    for epoch in itertools.count():
        produced = 0
        for micro_batch in epoch_micro_batches(shard, job.data, pad_id,
                                               job.train.seed * 1000 + epoch):
            produced += 1
            yield micro_batch
        if not produced:
            raise RuntimeError(f"worker {rank} received no training rows: the dataset has fewer "
                               f"rows than workers (train.workers={job.train.workers})")


def epoch_micro_batches(dataset, data: DataConfig, pad_id: int, seed: int
                        ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One pass over `dataset`'s rows (a Ray Dataset or shard) as token-budget micro-batches,
    rows shuffled locally and packed with `seed`."""
    rows = ((ids, mask) for batch in dataset.iter_batches(
                batch_size=data.shuffle_window, batch_format="numpy",
                local_shuffle_buffer_size=data.shuffle_window, local_shuffle_seed=seed)
            for ids, mask in zip(batch["input_ids"], batch["loss_mask"], strict=True))
    yield from token_budget_micro_batches(rows, data.max_tokens_per_micro_batch,
                                          data.micro_batch_size, data.shuffle_window, pad_id,
                                          seed)


class TimedIterator:
    """An iterator that adds up the time spent inside its `next` (`seconds`)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.seconds = iterator, 0.0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self):
        started = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.seconds += time.perf_counter() - started


def _warmup_cosine(train: TrainConfig):
    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor
