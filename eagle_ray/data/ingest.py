"""Chat data at cluster scale: files -> Ray Data -> tokenised rows, streamed to the trainers.

Nothing is collected on the driver. `read_chats` reads JSONL or Parquet (a file, a folder, or a
list of them) with Ray Data; `tokenized` adds a `map_batches` stage that renders and masks each
conversation with the target's chat template (`eagle_ray.data.chat`) on the cluster's CPUs and marks
what happened to it; the workers read their shard with `ray.train.get_dataset_shard` and build
token-budget micro-batches (`eagle_ray.data.token_budget_micro_batches`). The driver makes one
streaming pass (`count_answers`) for the draft vocabulary and the counts, cached beside it.
Small inputs (`data.tokenize_in_driver_mb`) are tokenised by the same stage in the driver
(`tokenized_in_driver`): the same rows, without starting tokenising actors.

Held-out evaluation conversations are the first `eval_samples` of the dataset (deterministic),
removed from training by content.

A vision-language target's data (an image processor beside its tokenizer) goes through the same
stage with its processor (`tokenize_image_row`), images decoded on the stage's actors: each row
then has `IMAGE_COLUMNS` too (empty for a text row); a text-only target's rows have neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.data
import torch

from eagle_ray.backends.base import Sampling
from eagle_ray.config import ConfigError, DataConfig, JobConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.chat import conversation_key, conversation_messages, is_json_array
from eagle_ray.data.draft_vocab import count_answers, load_or_build_draft_vocab
from eagle_ray.data.images import (
    chat_source,
    has_image_processor,
    image_problem,
    image_root,
    load_vision_processor,
    with_image_root,
)
from eagle_ray.data.micro_batches import micro_batches_per_epoch
from eagle_ray.data.tokenize import (
    IMAGE_LOAD_DROPS,
    TRAINED,
    job_statuses,
    tokenize_image_row,
    tokenize_row,
)
from eagle_ray.pool.client import PoolClient

logger = logging.getLogger(__name__)

CHAT_COLUMNS = ("messages", "conversations")
# `data.path: null` trains on the kit's chats answered by "another model" (`tiny`), so that
# regenerating them with the target changes what the draft learns, as with real datasets.
GENERATED_WRITER = "other"
# Training rows smaller than this share of the cluster's object store are materialised there
# once instead of re-read every epoch; a row costs its ids and mask (int64 each) per token.
CACHE_SHARE = 0.1
BYTES_PER_TOKEN = 16
# Tokenised bytes per byte of chat file, an upper estimate (~4 bytes of text per token, 16 bytes
# per token once tokenised, plus each row's key): known small data is tokenised once.
TOKENIZED_BYTES_PER_INPUT_BYTE = 8
TOKENIZE_BATCH_ROWS = 64
# Image rows carry their RGB bytes (2.3 KB per image token at Qwen2.5-VL's 28-pixel merged
# patch): smaller blocks keep the stage's memory bounded.
IMAGE_TOKENIZE_BATCH_ROWS = 8
IMAGE_COLUMNS = ("pixels", "image_sizes")  # `ImageInputs`' layout, per row


def read_chats(paths: str | list[str] | None, num_samples: int, cpus_per_task: float):
    """The chat data as a Ray Dataset with a `messages` or `conversations` column per row:
    JSONL, JSON-array (a ShareGPT dump) or Parquet files or folders, or the built-in generated
    data when `paths` is None."""
    if paths is None:
        from eagle_ray.tiny import generate_chat_samples

        return ray.data.from_items(generate_chat_samples(num_samples, writer=GENERATED_WRITER))
    paths = [paths] if isinstance(paths, str) else list(paths)
    parquet = [p for p in paths if _is_parquet(p)]
    arrays = [p for p in paths if p not in parquet and Path(p).is_file() and is_json_array(p)]
    jsonl = [p for p in paths if p not in parquet and p not in arrays]
    datasets = []
    if jsonl:
        datasets.append(ray.data.read_json(jsonl, lines=True, num_cpus=cpus_per_task))
    if arrays:  # Ray reads a file that is one JSON array row by row without `lines`
        datasets.append(ray.data.read_json(arrays, num_cpus=cpus_per_task))
    if parquet:
        datasets.append(ray.data.read_parquet(parquet, num_cpus=cpus_per_task))
    if len(datasets) == 1:
        return datasets[0]
    # JSONL reads into pandas blocks, Parquet into Arrow ones; a batch must not mix the two.
    return datasets[0].union(*datasets[1:]).map_batches(
        _same, batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
        num_cpus=cpus_per_task)


def _same(batch):
    return batch


def _is_parquet(path: str) -> bool:
    target = Path(path)
    if target.is_dir():
        return any(target.glob("*.parquet"))
    return target.suffix == ".parquet"


class TokenizeChats:
    """The `map_batches` stage: `eagle_ray.data.tokenize_row` for each conversation; every row
    comes out with its `status`, `key`, `input_ids`, `loss_mask` and `length`, and for a
    vision-language target its images' `pixels` and `image_sizes` (`IMAGE_COLUMNS`; image paths
    relative to `image_root`)."""

    def __init__(self, tokenizer_at: str, max_length: int, vocab_size: int, overlong: str,
                 image_root: str | None = None, pixel_bounds: dict | None = None) -> None:
        from transformers import AutoTokenizer

        self.vision = load_vision_processor(tokenizer_at, pixel_bounds)
        self.tokenizer = (self.vision.tokenizer if self.vision is not None
                          else AutoTokenizer.from_pretrained(tokenizer_at))
        self.max_length, self.vocab_size, self.overlong = max_length, vocab_size, overlong
        self.image_root = image_root

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = ("status", "key", "input_ids", "loss_mask", "length")
        columns = {name: [] for name in names + (IMAGE_COLUMNS + ("problem",) if self.vision
                                                 else ())}
        for i in range(len(next(iter(batch.values())))):
            messages = row_messages({c: batch[c][i] for c in CHAT_COLUMNS if c in batch})
            if self.vision is None:
                status, ids, mask = tokenize_row(self.tokenizer, messages, self.max_length,
                                                 self.vocab_size, self.overlong, "a dataset row")
            else:
                status, ids, mask, pixels, sizes = tokenize_image_row(
                    self.vision, messages, self.max_length, self.vocab_size, self.overlong,
                    "a dataset row", self.image_root)
                columns["pixels"].append(pixels)
                columns["image_sizes"].append(sizes)
                columns["problem"].append(image_problem(messages, self.image_root)
                                          if status in IMAGE_LOAD_DROPS else "")
            for name, value in (("status", status), ("key", conversation_key(messages)),
                                ("input_ids", np.asarray(ids, dtype=np.int64)),
                                ("loss_mask", np.asarray(mask, dtype=np.int64)),
                                ("length", len(ids))):
                columns[name].append(value)
        return {name: _column(values) for name, values in columns.items()}


def row_messages(columns: dict[str, Any]) -> list[dict[str, Any]]:
    """A dataset row's conversation, whichever of the two shapes it has."""
    return conversation_messages({c: _plain(v) for c, v in columns.items() if _present(v)},
                                 "a dataset row")


def tokenized(dataset, tokenizer_at: str, max_length: int, vocab_size: int, overlong: str,
              cpus_per_task: float, workers: int = 1, image_root: str | None = None,
              pixel_bounds: dict | None = None):
    """`dataset` with the tokenisation stage added (lazy: nothing runs until it is read), on
    `workers` actors (where a vision-language target's images are decoded and resized, within
    `pixel_bounds`: vLLM's `mm_processor_kwargs`)."""
    images = has_image_processor(tokenizer_at)
    return dataset.map_batches(
        TokenizeChats, batch_size=IMAGE_TOKENIZE_BATCH_ROWS if images else TOKENIZE_BATCH_ROWS,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=cpus_per_task,
        fn_constructor_kwargs={"tokenizer_at": tokenizer_at, "max_length": max_length,
                               "vocab_size": vocab_size, "overlong": overlong,
                               "image_root": image_root, "pixel_bounds": pixel_bounds})


def tokenized_in_driver(dataset, stage: TokenizeChats):
    """`tokenized`'s rows, made by `stage` in this process and put in the object store as
    blocks (as `map_batches` makes them): for small data, where starting Ray Data's tokenising
    actors (~15 s on a 2-core machine) costs more than the work."""
    from ray.data.block import BlockAccessor

    return ray.data.from_blocks([
        BlockAccessor.batch_to_block(stage(batch))
        for batch in dataset.iter_batches(batch_size=TOKENIZE_BATCH_ROWS, batch_format="numpy")])


def held_out(dataset, count: int) -> list[list[dict[str, Any]]]:
    """The first `count` conversations of `dataset`, in its order (deterministic)."""
    if count <= 0:
        return []
    return [row_messages({c: r.get(c) for c in CHAT_COLUMNS})
            for r in dataset.limit(count).take_all()]


def training_rows(tokenized_dataset, held_out_keys: Iterable[str], cpus_per_task: float = 0.25):
    """Rows the trainers read: kept or truncated, and not held out."""
    excluded = frozenset(held_out_keys)
    return tokenized_dataset.filter(
        lambda row: row["status"] in TRAINED and row["key"] not in excluded,
        num_cpus=cpus_per_task)


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and np.isnan(value))


def _plain(value: Any) -> Any:
    """Arrow/numpy nested values as plain Python lists and dicts."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _column(values: list[Any]) -> np.ndarray:
    if values and isinstance(values[0], np.ndarray):
        column = np.empty(len(values), dtype=object)
        column[:] = values
        return column
    return np.asarray(values)


@dataclasses.dataclass
class JobData:
    """What the training job trains on and evaluates with."""

    train: Any  # Ray Dataset of training rows (`input_ids`, `loss_mask`, ...), lazily streamed
    held_out: list[list[dict[str, str]]]  # evaluation conversations (never trained on)
    vocab: DraftVocab
    statuses: dict[str, int]  # what happened to the training conversations (`data.STATUSES`)
    regenerated: dict[str, Any] | None  # the regeneration report, when answers were regenerated
    micro_batches_per_epoch: float | None = None  # per worker (measured for `train.epochs`)


def prepare_job_data(config: JobConfig, served: TargetIdentity, tokenizer_at: str, tokenizer,
                     client: PoolClient, output_dir: Path) -> JobData:
    """Read (and, with `regenerate.enabled`, regenerate) the job's data; split off the held-out
    conversations; build the tokenised training dataset and the draft vocabulary."""
    # The workers' split coordinator re-executes the dataset every epoch; Ray Data's progress
    # bars would print a set per execution into the driver's console. The job logs its counts.
    ray.data.DataContext.get_current().enable_progress_bars = False
    data = dataclasses.replace(config.data, path=chat_source(config, output_dir))
    source = read_chats(data.path, data.num_samples, data.cpus_per_task)
    input_bytes = _input_bytes(data.path, source)
    if _fits_the_driver(input_bytes, data):
        source = source.materialize()  # read once for the held-out split and the tokenising
    held = held_out(source, data.eval_samples)
    held_keys = {conversation_key(m) for m in held}
    held = [with_image_root(m, image_root(data.path)) for m in held]
    regenerated = None
    if config.regenerate.enabled:
        path, regenerated = regenerate_job_data(config, served, tokenizer, client, held_keys,
                                                output_dir)
        source = read_chats(str(path), 0, data.cpus_per_task)
        input_bytes = _input_bytes(str(path), source)
    max_length = min(data.max_length, served.max_length or data.max_length)
    stage = (tokenizer_at, max_length, served.vocab_size, data.overlong)
    budget = CACHE_SHARE * _object_store_bytes()  # bytes the kept rows may take
    # Images are decoded on the stage's actors, never here; their pixels are not in input_bytes.
    vision = has_image_processor(tokenizer_at)
    if _fits_the_driver(input_bytes, data) and not vision:
        rows, keep = tokenized_in_driver(source, TokenizeChats(*stage)), True
    else:
        rows = tokenized(source, *stage, data.cpus_per_task, data.tokenize_workers,
                         image_root=image_root(data.path),
                         pixel_bounds=config.target.vllm_kwargs.get("mm_processor_kwargs"))
        keep = not vision and input_bytes is not None \
            and input_bytes * TOKENIZED_BYTES_PER_INPUT_BYTE < budget
        if keep:
            # One tokenising execution serves the counting pass and every epoch (each execution
            # starts its readers and tokenising actors: ~15 s on a 2-core machine).
            rows = rows.materialize()
    cache_source = {"data": data.path, "num_samples": data.num_samples, "max_length": max_length,
                    "overlong": data.overlong, "eval_samples": data.eval_samples,
                    "target": served.fingerprint,
                    "regenerated": regenerated["file"] if regenerated else None}

    def count() -> tuple[torch.Tensor, dict[str, int]]:
        counts, statuses, tokens, dropped = count_answers(rows, held_keys, served.vocab_size,
                                                          vision)
        return torch.from_numpy(counts), job_statuses(statuses, tokens, vision, dropped)

    vocab, statuses = load_or_build_draft_vocab(output_dir / "draft_vocab.json", cache_source,
                                                count, served.vocab_size, data.draft_vocab_size)
    logger.info("data: %s (max_length %d); %d held out", statuses, max_length, len(held))
    train = training_rows(rows, held_keys, data.cpus_per_task)
    train_bytes = statuses["training_tokens"] * BYTES_PER_TOKEN + (
        statuses.get("training_image_bytes", 0) if vision else 0)
    if keep or train_bytes < budget:
        # Small enough to keep: later epochs then neither re-read nor re-tokenise (a new
        # execution per epoch starts a tokenising actor and leaves the trainers waiting).
        logger.info("keeping the tokenised training rows in the object store (%.1f MiB)",
                    train_bytes / 2**20)
        train = train.materialize()
    per_epoch = None
    if config.train.epochs is not None:  # one more pass, over the rows' lengths only
        lengths = [int(n) for batch in (train.select_columns(["length"]) if vision else train
                                        ).iter_batches(batch_size=4096, batch_format="numpy")
                   for n in batch["length"]]
        per_epoch = micro_batches_per_epoch(lengths, data.max_tokens_per_micro_batch,
                                            data.micro_batch_size, data.shuffle_window,
                                            config.train.workers)
    return JobData(train, held, vocab, {**statuses, "max_length": max_length}, regenerated,
                   per_epoch)


def _object_store_bytes() -> float:
    return float(ray.cluster_resources().get("object_store_memory", 0.0))


def _fits_the_driver(input_bytes: int | None, data: DataConfig) -> bool:
    return input_bytes is not None and input_bytes <= data.tokenize_in_driver_mb * 2**20


def _input_bytes(paths: str | list[str] | None, source) -> int | None:
    """Bytes of the job's chat data before tokenising, where known without reading it: local
    files and folders by size, the generated data (built in memory) by Ray's metadata; None for
    anything else (remote storage)."""
    if paths is None:
        return source.size_bytes()
    total = 0
    for path in [paths] if isinstance(paths, str) else paths:
        target = Path(path)
        if target.is_file():
            total += target.stat().st_size
        elif target.is_dir():
            total += sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        else:
            return None
    return total


def regenerate_job_data(config: JobConfig, served: TargetIdentity, tokenizer,
                        client: PoolClient, held_keys: set[str], output_dir: Path
                        ) -> tuple[Path, dict[str, Any]]:
    """The job's training conversations with the target's own answers, cached in `output_dir`
    (named by what they depend on; an interrupted run resumes)."""
    from eagle_ray.data.regenerate import regenerate_file
    from eagle_ray.tiny import write_chat_dataset

    data, settings = config.data, config.regenerate
    if data.path is None:
        source = write_chat_dataset(output_dir / f"chats-{data.num_samples}.jsonl",
                                    data.num_samples, writer=GENERATED_WRITER)
    elif isinstance(data.path, str) and Path(data.path).is_file() \
            and not _is_parquet(data.path):
        source = Path(data.path)
    else:
        raise ConfigError("regenerate.enabled needs data.path to be one JSONL or JSON-array "
                          f"file (or null for the generated data), got {data.path!r}; run "
                          "`eagle-ray regenerate` per file first")
    sampling = Sampling(max_new_tokens=settings.max_new_tokens,
                        temperature=settings.temperature, top_p=settings.top_p,
                        seed=settings.seed)
    depends_on = json.dumps([_file_digest(source), served.fingerprint,
                             dataclasses.asdict(sampling), sorted(held_keys)])
    path = output_dir / f"regenerated-{hashlib.sha1(depends_on.encode()).hexdigest()[:12]}.jsonl"
    report = regenerate_file(client, tokenizer, source, path, sampling,
                             fingerprint=served.fingerprint, skip_keys=held_keys,
                             conversations_per_wave=settings.conversations_per_wave,
                             prompts_per_request=settings.prompts_per_request)
    return path, {**dataclasses.asdict(report), "changed_share": round(report.changed_share, 4),
                  "file": str(path)}


def _file_digest(path: Path) -> str:
    """Content hash of a file (read in chunks): the regenerated cache follows the data."""
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()
