"""One Ray Train worker of the draft-training job (`eagle_ray.train.job.run_job` starts them).

Each worker streams its shard's micro-batches through a `PoolClient` -- the in-flight window
prefetches supervision, so target latency overlaps the draft's compute -- and trains with DDP,
AdamW (or Muon beside it), warm-up + cosine decay and gradient clipping; checkpoints go through
`ray.train.Checkpoint`, and a rerun with the same `run_name` resumes. Rank 0 exports the draft
for the target the pool served. The learner (`DraftLearner`) imports no Ray -- `bench gpu` runs
it on machines without Ray -- so Ray and the pool are imported where a worker uses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from eagle_ray.config import ClientConfig, DataConfig, JobConfig, TrainConfig, to_dict
from eagle_ray.contract.checkpoint import load_embedding_and_head
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.losses import SlotLoss
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.data.micro_batches import padding_share, token_budget_micro_batches
from eagle_ray.data.supervision_cache import SupervisionCache
from eagle_ray.draft.dflash import BlockWeighting
from eagle_ray.draft.export import export_draft
from eagle_ray.draft.kinds import build_draft
from eagle_ray.draft.model import DraftConfig
from eagle_ray.plan import check_worker_memory
from eagle_ray.train.device import DevicePrefetcher, autocast_dtype
from eagle_ray.train.nonfinite import NonFiniteGuard
from eagle_ray.train.optimizers import DraftOptimizer
from eagle_ray.train.run_record import RECORD_FILE
from eagle_ray.train.trackers import Trackers

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "draft_state.pt"
SETUP_KEY = "setup"  # Ray Train takes a dict: the WorkerSetup travels under this key


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What the driver hands every Ray Train worker: the job, the target the pool serves and
    what the driver derived from the data (draft vocabulary, pad and mask tokens)."""

    job: JobConfig
    model_path: str  # the target checkpoint as the job names it (embedding and head)
    served: TargetIdentity
    draft_to_target: list[int]
    pad_id: int
    output_dir: str
    run_record: dict[str, Any]  # saved beside every checkpoint (what a rerun may resume)
    mask_token_id: int | None = None  # a P-EAGLE or DFlash draft's
    progress: Any = None  # the driver's `console.ProgressBoard` actor (rank 0 posts to it)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: stream supervision from the pool, train the draft with DDP."""
    import ray.train
    import ray.train.torch

    setup: WorkerSetup = loop_config[SETUP_KEY]
    job = setup.job
    train = job.train
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(train.seed)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        # fp32 matmuls (fp32 precision, or what autocast leaves) use TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        check_worker_memory(job, setup.model_path)
    learner = DraftLearner.for_worker(setup, device)
    start_step = learner.resume(ray.train.get_checkpoint(), rank)
    micro_batches, supervision = _supervision(setup, rank, world, start_step)
    on_device = DevicePrefetcher(supervision, device)
    window = MetricsWindow(micro_batches, world)
    outputs = RankOutputs(setup, rank)
    outputs.started(start_step)
    for step in range(start_step, train.steps):
        waited = time.perf_counter()
        host_batch, batch = next(on_device)
        window.add_batch(host_batch, time.perf_counter() - waited)
        values = learner.step(batch)
        window.add_values(values, skipped=learner.skipped)
        done = step + 1
        if done % train.log_every and done % train.checkpoint_every and done != train.steps:
            outputs.progress(done)
            continue
        metrics, worker_tokens_per_s = window.flush(done, learner.optimizer.lr,
                                                    learner.guard.skipped)
        outputs.log(done, metrics, worker_tokens_per_s)
        if done % train.checkpoint_every == 0 or done == train.steps:
            outputs.checkpoint(metrics, learner, done)
        else:
            ray.train.report(metrics)
    outputs.close()
    if rank == 0:
        export_draft(learner.draft, learner.vocab, setup.served,
                     Path(setup.output_dir) / "draft", train.ttt_steps)


class DraftLearner:
    """The draft (any kind: its `objective` is the loss of a step, each slot scored with
    `train.loss`), wrapped for DDP, with its optimizers and schedule (`train.optimizer`): one
    TTT step at a time. A step with a non-finite loss or gradient is skipped on every rank
    (`guard`, `skipped`).

    `prepare` wraps the draft for its workers (Ray Train's `prepare_model`: DDP, the device);
    None moves it to `device` unwrapped (one process, as in tests)."""

    def __init__(self, draft: torch.nn.Module, head: TargetHead, vocab: DraftVocab,
                 train: TrainConfig, device: torch.device,
                 prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None) -> None:
        self.train, self.device, self.head = train, device, head.to(device)
        self.precision = autocast_dtype(train.precision, device)  # None: fp32 throughout
        self.vocab, self.draft = vocab, draft
        self.model = prepare(draft) if prepare else draft.to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss = SlotLoss(train.loss, train.lk_eta)
        self.optimizer = DraftOptimizer(self.model, train)
        self.guard = NonFiniteGuard(train.max_nonfinite_steps)
        self.skipped = False  # the last step wrote nothing: its loss or gradient was not finite

    @classmethod
    def for_worker(cls, setup: WorkerSetup, device: torch.device) -> DraftLearner:
        """A Ray Train worker's learner: the target's frozen embedding and head (fp32) from its
        checkpoint, the draft vocabulary the job chose, DDP through `prepare_model`."""
        import ray.train.torch
        from transformers import AutoConfig

        train = setup.job.train
        target_config = AutoConfig.from_pretrained(setup.model_path)
        embedding, head = load_embedding_and_head(setup.model_path, torch.float32)
        vocab = DraftVocab(torch.tensor(setup.draft_to_target), setup.served.vocab_size)
        spec = setup.job.draft
        config = DraftConfig.from_target(target_config, vocab.size, train.intermediate_size,
                                         spec.num_layers, len(setup.served.aux_layer_ids))
        draft = build_draft(spec.kind, config, embedding.weight, setup.mask_token_id,
                            spec.anchors_per_row, BlockWeighting(
                                spec.loss_weighting, spec.loss_decay_gamma, spec.dpace_alpha))
        return cls(draft, head, vocab, train, device, ray.train.torch.prepare_model)

    def save(self, directory: Path, step: int) -> None:
        """Write the draft, optimizers and schedule at `step` into `directory` (what `resume`
        reads)."""
        state = {"draft": self.draft.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": step, "nonfinite_steps": self.guard.skipped}
        torch.save(state, Path(directory) / CHECKPOINT_FILE)

    def resume(self, checkpoint, rank: int) -> int:
        """Load Ray Train's latest checkpoint, if any; the step to start from.

        Its tensors load into host memory: as saved they name rank 0's GPU, which a node's
        workers all see (Ray Train shares CUDA_VISIBLE_DEVICES), so each would put the draft and
        AdamW's state there; `load_state_dict` copies them onto this learner's device. A
        checkpoint from before `train.optimizer` existed holds one AdamW and its schedule."""
        if checkpoint is None:
            return 0
        with checkpoint.as_directory() as ckpt_dir:
            state = torch.load(Path(ckpt_dir) / CHECKPOINT_FILE, map_location="cpu",
                               weights_only=False)
        self.draft.load_state_dict(state["draft"])
        optimizer = state["optimizer"]
        if "scheduler" in state:
            optimizer = {"optimizers": [optimizer], "schedules": [state["scheduler"]]}
        self.optimizer.load_state_dict(optimizer)
        self.guard.skipped = state.get("nonfinite_steps", 0)
        logger.info("worker %d resumes at step %d", rank, state["step"])
        return state["step"]

    def step(self, batch) -> dict[str, torch.Tensor]:
        """One optimizer step on `batch`; its loss, gradient norm and per-TTT-step losses and
        accuracies, left on the device. Where the loss or gradient is not finite on any rank,
        the step is skipped (`skipped`): its gradient dropped, no weight or optimizer state
        written; the schedule advances all the same (`NonFiniteGuard`)."""
        probs, position_mask = draft_target(batch, self.vocab, self.head)
        with (torch.autocast(self.device.type, dtype=self.precision) if self.precision
              else contextlib.nullcontext()):
            loss, step_losses, step_accuracies = self.draft.objective(
                self.model, batch.aux_hidden_states, batch.input_ids, batch.loss_mask, probs,
                position_mask, self.train.ttt_steps, batch.positions, self.loss)
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.train.grad_clip)
        self.skipped = not self.guard.take(loss, grad_norm, self.optimizer.scheduled_steps + 1)
        if self.skipped:
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
        self.optimizer.advance_schedule()
        return {"loss": loss.detach(), "grad_norm": grad_norm,
                **{f"loss_{k}": v for k, v in enumerate(step_losses)},
                **{f"acc_{k}": v for k, v in enumerate(step_accuracies)}}


def _supervision(setup: WorkerSetup, rank: int, world: int, start_step: int
                 ) -> tuple[TimedIterator, Iterator]:
    """(the micro-batches read, timed; their supervision): from the supervision cache, or the
    worker's data shard streamed through the pool."""
    import ray.train

    from eagle_ray.pool import PoolClient

    job, train = setup.job, setup.job.train
    if job.data.supervision_cache:
        # Supervision read from disk: the time spent reading counts as waiting for data.
        micro_batches = TimedIterator(SupervisionCache.open(job.data.supervision_cache).stream(
            rank, world, train.seed + start_step))
        return micro_batches, micro_batches
    client = PoolClient.connect(job.target.name, job.target.namespace,
                                ClientConfig(max_inflight_micro_batches=train.prefetch))
    micro_batches = TimedIterator(itertools.islice(
        shard_micro_batches(ray.train.get_dataset_shard("train"), job, setup.pad_id,
                            rank), train.steps - start_step))
    return micro_batches, client.stream(micro_batches)


class MetricsWindow:
    """Logged metrics average over the steps since the last log (single steps are noisy), the
    steps skipped for a non-finite loss or gradient left out (NaN where every one was). Sums
    stay on the device (one host sync per log); host-side statistics are read from the host
    batch."""

    def __init__(self, micro_batches: TimedIterator, world: int) -> None:
        self.micro_batches, self.world = micro_batches, world
        self.names: list[str] = []  # of a step's values, kept across windows
        self._reset()

    def _reset(self) -> None:
        self.start, self.tokens, self.wait = time.perf_counter(), 0, 0.0
        self.data_wait_before = self.micro_batches.seconds
        self.sums: dict[str, torch.Tensor] = {}
        self.padding, self.batches, self.steps = 0.0, 0, 0

    def add_batch(self, host_batch, waited_s: float) -> None:
        self.wait += waited_s
        self.batches += 1
        self.padding += padding_share(
            (host_batch.input_ids, host_batch.attention_mask, host_batch.loss_mask))
        self.tokens += int(host_batch.attention_mask.sum())

    def add_values(self, values: dict[str, torch.Tensor], skipped: bool = False) -> None:
        """A step's values; a `skipped` step's are not averaged (they are not finite)."""
        self.names = self.names or list(values)
        if skipped:
            return
        self.steps += 1
        for name, value in values.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def flush(self, step: int, lr: float, nonfinite_steps: int = 0
              ) -> tuple[dict[str, float], float]:
        """The window's metrics at `step` and this worker's tokens/s (`nonfinite_steps`: the
        steps skipped so far, in all); the next window starts now."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        data_wait = self.micro_batches.seconds - self.data_wait_before
        means = ((torch.stack([self.sums[n].float() for n in self.names]) / self.steps).tolist()
                 if self.steps else [math.nan] * len(self.names))
        metrics = {"step": step, "lr": lr, **dict(zip(self.names, means, strict=True)),
                   "nonfinite_steps": nonfinite_steps,
                   "padding_share": self.padding / max(self.batches, 1),
                   "supervision_tokens_per_s": self.tokens * self.world / elapsed,
                   # Waiting for supervision includes reading the data (the client pulls the
                   # next micro-batch when it has room): report the two apart.
                   "pool_wait_share": max(self.wait - data_wait, 0.0) / elapsed,
                   "data_wait_share": data_wait / elapsed}
        worker_tokens_per_s = self.tokens / elapsed
        self._reset()
        return metrics, worker_tokens_per_s


class RankOutputs:
    """Where a worker's metrics go: Prometheus from every worker; metrics.jsonl, the driver's
    progress bar (`console.ProgressBoard`) and the experiment trackers from rank 0; and
    checkpoints through `ray.train.report`."""

    def __init__(self, setup: WorkerSetup, rank: int) -> None:
        from eagle_ray.pool.telemetry import TrainerMetrics  # Ray's metrics: the learner needs none

        job, train = setup.job, setup.job.train
        self.rank, self.record = rank, setup.run_record
        self.metrics_path = Path(setup.output_dir) / "metrics.jsonl"
        self.board = setup.progress if rank == 0 else None
        self.trackers = Trackers(train.loggers, Path(setup.output_dir), job.run_name,
                                 to_dict(job), train.mlflow_tracking_uri,
                                 train.mlflow_experiment) if rank == 0 and train.loggers else None
        self.telemetry = TrainerMetrics(job.run_name, rank)

    def progress(self, step: int) -> None:
        if self.board is not None:
            self.board.post.remote(step)

    def started(self, step: int) -> None:
        """The worker group (re)started at `step` (its checkpoint's, or 0): the records logged
        after it by a group that failed go, so metrics.jsonl keeps one record per step; the
        driver says so on the console when it is a restart."""
        if self.rank != 0:
            return
        if self.metrics_path.exists():
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if json.loads(line)["step"] <= step]
            self.metrics_path.write_text("".join(f"{line}\n" for line in kept))
        if self.board is not None:
            self.board.started.remote(step)

    def log(self, step: int, metrics: dict[str, float], worker_tokens_per_s: float) -> None:
        self.telemetry.report(worker_tokens_per_s, metrics["pool_wait_share"])
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.board is not None:
            self.board.post.remote(step, metrics)
        if self.trackers is not None:
            self.trackers.log(metrics, step)

    def checkpoint(self, metrics: dict[str, float], learner: DraftLearner, step: int) -> None:
        """Report `metrics` with a checkpoint of `learner` at `step` (written by rank 0)."""
        import ray.train

        with tempfile.TemporaryDirectory() as tmp:
            if self.rank == 0:
                learner.save(Path(tmp), step)
                (Path(tmp) / RECORD_FILE).write_text(json.dumps(self.record))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp)
                             if self.rank == 0 else None)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()


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
                        ) -> Iterator[tuple[torch.Tensor, ...]]:
    """One pass over `dataset`'s rows (a Ray Dataset or shard) as token-budget micro-batches,
    rows shuffled locally and packed with `seed`. A vision-language target's rows carry
    `pixels` and `image_sizes`: a micro-batch with images ends in its `ImageInputs`."""
    rows = (row for batch in dataset.iter_batches(
                batch_size=data.shuffle_window, batch_format="numpy",
                local_shuffle_buffer_size=data.shuffle_window, local_shuffle_seed=seed)
            for row in zip(batch["input_ids"], batch["loss_mask"],
                           *[batch[c] for c in ("pixels", "image_sizes") if c in batch],
                           strict=True))
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

