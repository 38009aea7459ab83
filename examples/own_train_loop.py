"""Your own Ray Train loop, fed by an eagle_ray pool (docs/library.md).

    python examples/own_train_loop.py            # starts the tiny target's pool if none runs

or against a pool that outlives the script (a Ray cluster first; `eagle-ray serve` refuses a
cluster without token authentication unless --allow-insecure):

    ray start --head
    eagle-ray serve --allow-insecure             # pool "eagle_ray_pool", namespace "eagle_ray"
    python examples/own_train_loop.py --expect-aux-layer-ids 1 3 4
    eagle-ray shutdown

The driver finds or starts the pool, checks what it serves against what the draft expects, and
sizes the workers' window against it. Only plain values cross into the Ray Train workers: the
pool's name and namespace, the `ClientConfig` window and the served `TargetIdentity` as a dict;
each worker connects its own `PoolClient`. The draft is a toy (one linear layer from the three
aux states to the hidden size, decoded by the target's own frozen head), not eagle_ray's EAGLE-3
draft: put yours in its place.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import eagle_ray as er

logger = logging.getLogger("own_train_loop")
TOKENS_PER_MICRO_BATCH = 4 * 48


def connect_or_start(name: str, namespace: str, **config) -> tuple[er.TargetPool, bool]:
    """The running pool `name`, or a new one (`PoolConfig(**config)`: the tiny target by
    default) that this script owns; returns it and whether it was started here."""
    try:
        return er.TargetPool.connect(name, namespace), False
    except ValueError:
        logger.info("no pool %r in namespace %r: starting one", name, namespace)
        return er.TargetPool.create(er.PoolConfig(name=name, namespace=namespace, **config)), True


def toy_micro_batches(vocab_size: int, count: int, seed: int):
    """Stand-in for your data loader: right-padded rows of random ids, loss on the second
    half of each row."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        lengths = torch.randint(16, 48, (4,), generator=generator).tolist()
        ids = torch.zeros(4, max(lengths), dtype=torch.long)
        attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, :n] = torch.randint(3, vocab_size, (n,), generator=generator)
            attention[row, :n] = 1
            loss[row, n // 2:n] = 1
        yield ids, attention, loss


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: its own client, a toy draft, DDP, a checkpoint per report."""
    rank = ray.train.get_context().get_world_rank()
    served = er.TargetIdentity.from_dict(config["served"])
    client = er.PoolClient.connect(config["pool_name"], config["namespace"], config["window"])
    device = ray.train.torch.get_device()
    _, head = er.load_embedding_and_head(served.model_path, getattr(torch, served.dtype))
    head = head.to(device)
    vocab = er.DraftVocab.from_target_ids(range(served.vocab_size), served.vocab_size)
    torch.manual_seed(0)
    draft = ray.train.torch.prepare_model(
        torch.nn.Linear(3 * served.hidden_size, served.hidden_size))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    start = 0
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "draft.pt")
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    micro_batches = toy_micro_batches(served.vocab_size, config["steps"] - start,
                                      seed=1000 * rank + start)
    for step, batch in enumerate(client.stream(micro_batches), start=start + 1):
        if config.get("save_supervision") and rank == 0:
            save_supervision(batch, Path(config["save_supervision"]) / f"step-{step}.safetensors")
        batch = batch.to(device)
        target_probs, position_mask = er.draft_target(batch, vocab, head)
        logits = head(draft(batch.aux_hidden_states.float()).to(head.lm_head.weight.dtype))
        loss = er.soft_cross_entropy(logits, target_probs, position_mask, batch.loss_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, Path(folder) / "draft.pt")
            ray.train.report({"step": step, "loss": loss.item()},
                             checkpoint=Checkpoint.from_directory(folder) if rank == 0 else None)


def save_supervision(batch: er.Eagle3TargetBatch, path: Path) -> None:
    """What the draft trained on, for a look later (or a comparison with the target run
    in-process); results are read-only views, so `clone` before anything writes to them."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: t.clone().contiguous() for name, t in batch.tensors().items()}, str(path))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    if not ray.is_initialized():
        ray.init(address=args.address)
    pool, started = connect_or_start(args.pool_name, args.namespace)
    try:
        served = pool.identity()
        er.expect_target(served, aux_layer_ids=args.expect_aux_layer_ids,
                         fingerprint=args.expect_fingerprint)
        window = er.size_window(pool, TOKENS_PER_MICRO_BATCH, clients=args.workers)
        logger.info("pool serves %s; each worker's window: %d micro-batches",
                    served.describe(), window.max_inflight_micro_batches)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"pool_name": args.pool_name, "namespace": args.namespace,
                               "window": window, "served": served.to_dict(),
                               "steps": args.steps, "save_supervision": args.save_supervision},
            scaling_config=ScalingConfig(
                num_workers=args.workers, use_gpu=args.use_gpu,
                resources_per_worker={"CPU": args.cpus_per_worker,
                                      **({"GPU": 1} if args.use_gpu else {})}),
            # a worker group that cannot be placed ends the run instead of waiting forever
            run_config=RunConfig(name="own_train_loop",
                                 storage_path=str(Path(args.output).resolve()),
                                 failure_config=FailureConfig(controller_failure_limit=0)))
        result = trainer.fit()
    except er.ConfigError as e:
        logger.error("%s", e)
        return 2
    finally:
        if started:
            pool.shutdown()
    logger.info("trained %d steps, loss %.4f; checkpoint at %s", result.metrics["step"],
                result.metrics["loss"], result.checkpoint.path)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="Ray cluster (default: the running "
                        "one, RAY_ADDRESS, or a new local instance)")
    parser.add_argument("--pool-name", default="eagle_ray_pool")
    parser.add_argument("--namespace", default="eagle_ray")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=0.5,
                        help="CPUs per worker (the tiny kit: two workers beside a replica on "
                             "two cores)")
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", default="runs/own_train_loop",
                        help="Ray Train storage (checkpoints)")
    parser.add_argument("--expect-aux-layer-ids", type=int, nargs=3, default=None,
                        help="the draft's aux layer ids; refuse a pool serving others")
    parser.add_argument("--expect-fingerprint", default=None,
                        help="the target checkpoint's fingerprint (eagle_ray."
                             "checkpoint_fingerprint); refuse a pool serving another")
    parser.add_argument("--save-supervision", default=None,
                        help="rank 0 also writes each micro-batch's supervision here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
