"""Supervision as a Ray Data stage, written once per row into an offline cache (docs/library.md).

    python examples/ray_data_supervision.py --output runs/supervision_rows

reads chat conversations (JSONL of {"messages": [...]}, default: the tiny kit's), tokenises them
with the target's chat template, streams them through the pool (`eagle_ray.map_supervision`:
a fixed pool of actors, each holding one `PoolClient` whose window is sized against the pool)
and writes each row's supervision to `<output>/<key>.safetensors` (`write_supervision_rows`).
It uses a running pool (`eagle-ray serve`, see examples/own_train_loop.py) or starts the tiny
target's pool itself.

Exactly once: a row's key is a hash of its conversation, stable across runs and Ray Data's
re-execution of a block; the supervision of a row depends on that row alone; the writer skips
keys already written and renames each file into place. Run it twice, or let Ray Data retry a
block, and the folder still holds one file per key (the second run writes nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys

import numpy as np
import ray
import ray.data

import eagle_ray as er

logger = logging.getLogger("ray_data_supervision")


def connect_or_start(name: str, namespace: str, **config) -> tuple[er.TargetPool, bool]:
    """The running pool `name`, or a new one (the tiny target by default) owned by this script;
    returns it and whether it was started here."""
    try:
        return er.TargetPool.connect(name, namespace), False
    except ValueError:
        logger.info("no pool %r in namespace %r: starting one", name, namespace)
        return er.TargetPool.create(er.PoolConfig(name=name, namespace=namespace, **config)), True


def conversation_key(messages: list[dict[str, str]]) -> str:
    """A stable id of a conversation: the same rows get the same keys on every run."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:32]


class Tokenize:
    """Chat rows -> `key`, `input_ids` and `loss_mask` (1 on assistant tokens, as the chat
    template's `{% generation %}` markers say), truncated to what the target accepts."""

    def __init__(self, model_path: str, max_length: int | None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.max_length = max_length

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keys, ids, masks = [], [], []
        for conversation in batch["messages"]:
            messages = [{"role": str(m["role"]), "content": str(m["content"])}
                        for m in conversation]
            encoded = self.tokenizer.apply_chat_template(
                messages, return_dict=True, return_assistant_tokens_mask=True)
            keys.append(conversation_key(messages))
            ids.append(np.asarray(encoded["input_ids"][:self.max_length], dtype=np.int64))
            masks.append(np.asarray(encoded["assistant_masks"][:self.max_length], dtype=np.int64))
        return {"key": np.array(keys), "input_ids": ragged(ids), "loss_mask": ragged(masks)}


def ragged(arrays: list[np.ndarray]) -> np.ndarray:
    """A Ray Data column of rows of different lengths."""
    column = np.empty(len(arrays), dtype=object)
    for i, array in enumerate(arrays):
        column[i] = array
    return column


def supervision_pipeline(data: str, output: str, pool: er.TargetPool, served: er.TargetIdentity,
                         args: argparse.Namespace) -> ray.data.Dataset:
    """read -> tokenise -> supervision (the pool) -> keyed writer; lazy until consumed."""
    window = er.size_window(pool, args.max_tokens_per_micro_batch, clients=args.concurrency)
    logger.info("%d stage actor(s), each with a window of %d micro-batches",
                args.concurrency, window.max_inflight_micro_batches)
    # Every stage asks for a quarter CPU: on the tiny kit's two cores, beside a replica's one.
    cpus = args.cpus_per_stage
    tokens = ray.data.read_json(data, ray_remote_args={"num_cpus": cpus}).map_batches(
        Tokenize, fn_constructor_args=(served.model_path, served.max_length), batch_size=64,
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=cpus)
    supervised = er.map_supervision(
        tokens, pool.config.name, pool.config.namespace, window=window,
        concurrency=args.concurrency, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        expect={"aux_layer_ids": args.expect_aux_layer_ids,
                "fingerprint": args.expect_fingerprint}, num_cpus=cpus)
    return supervised.map_batches(er.write_supervision_rows, batch_size=16, num_cpus=cpus,
                                  fn_kwargs={"path": output, "identity": served.to_dict()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    if not ray.is_initialized():
        ray.init(address=args.address)
    data = args.data or str(er.tiny_chat_dataset(args.samples))
    pool, started = connect_or_start(args.pool_name, args.namespace)
    try:
        served = pool.identity()
        er.expect_target(served, aux_layer_ids=args.expect_aux_layer_ids,
                         fingerprint=args.expect_fingerprint)
        written = supervision_pipeline(data, args.output, pool, served, args).to_pandas()
    except er.ConfigError as e:
        logger.error("%s", e)
        return 2
    finally:
        if started:
            pool.shutdown()
    logger.info("%d rows: %d keys written now, %d rows skipped (key already written); %s "
                "holds %d keys", len(written), int(written["written"].sum()),
                int((~written["written"]).sum()), args.output, len(er.SupervisionRows(args.output)))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="Ray cluster (default: the running "
                        "one, RAY_ADDRESS, or a new local instance)")
    parser.add_argument("--pool-name", default="eagle_ray_pool")
    parser.add_argument("--namespace", default="eagle_ray")
    parser.add_argument("--data", default=None, help="chat JSONL (default: the tiny kit's)")
    parser.add_argument("--samples", type=int, default=48, help="kit conversations (no --data)")
    parser.add_argument("--output", default="runs/supervision_rows")
    parser.add_argument("--concurrency", type=int, default=2, help="stage actors (clients)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=512)
    parser.add_argument("--cpus-per-stage", type=float, default=0.25,
                        help="CPUs of each read, tokenise, supervision and write worker")
    parser.add_argument("--expect-aux-layer-ids", type=int, nargs=3, default=None,
                        help="the draft's aux layer ids; refuse a pool serving others")
    parser.add_argument("--expect-fingerprint", default=None,
                        help="the target checkpoint's fingerprint; refuse a pool serving another")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
