"""Ingest: chat files stream through Ray Data into training with the driver's memory flat, and
token-budget micro-batches pad less than fixed-row ones.

For each dataset size a JSONL file of multi-turn conversations (the tiny kit's chats, 1 to 12
turns each, so lengths spread as real chat data's do) goes through the job's own path:
`read_chats` -> `tokenized` -> `training_rows`, the driver's one counting pass
(`count_answers`), then `streaming_split` to consumer actors that pack token-budget
micro-batches, as Ray Train's `get_dataset_shard` does. A thread samples the driver's RSS the
whole time. Reported per size: conversations/s and the driver's peak RSS above its level before
the run; then the ratio of the largest to the smallest size's peak (flat: about 1, where
collecting the rows would grow with the data). On one sample of the same rows: the padding
share of token-budget micro-batches vs fixed-row micro-batches in shuffled order (the batching
it replaced), as a ratio.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

from eagle_ray.bench import emit
from eagle_ray.data.draft_vocab import count_answers
from eagle_ray.data.ingest import read_chats, tokenized, training_rows
from eagle_ray.data.micro_batches import make_micro_batches, token_budget_micro_batches
from eagle_ray.tiny import generate_chat_samples

logger = logging.getLogger(__name__)

MAX_TOKENS, MAX_ROWS, WINDOW = 16384, 8, 256  # the job's defaults (DataConfig)
PADDING_SAMPLE = 4096  # rows each consumer keeps for the side-by-side padding comparison


def write_multi_turn_chats(path: Path, conversations: int, seed: int = 0) -> Path:
    """`conversations` chats of 1-12 user/assistant turns (long-tailed), written as JSONL."""
    rng = random.Random(seed)
    pool = generate_chat_samples(4096, seed=seed)
    with open(path, "w") as f:
        for _ in range(conversations):
            turns = min(12, 1 + int(rng.expovariate(1 / 2.5)))
            picked = [pool[rng.randrange(len(pool))]["messages"] for _ in range(turns)]
            messages = picked[0][:1] + [m for sample in picked for m in sample[1:]]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@ray.remote(num_cpus=0)
class Consumer:
    """A training worker's reading side: token-budget micro-batches from its streamed shard."""

    def consume(self, shard) -> dict:
        rows = ((ids, mask) for batch in shard.iter_batches(batch_size=WINDOW,
                                                             batch_format="numpy")
                for ids, mask in zip(batch["input_ids"], batch["loss_mask"], strict=True))
        sample, counted = [], {"rows": 0, "micro_batches": 0, "slots": 0, "tokens": 0}

        def keep(stream):
            for row in stream:
                if len(sample) < PADDING_SAMPLE:
                    sample.append((row[0].tolist(), row[1].tolist()))
                counted["rows"] += 1
                yield row

        for micro_batch in token_budget_micro_batches(keep(rows), MAX_TOKENS, MAX_ROWS, WINDOW):
            counted["micro_batches"] += 1
            counted["slots"] += micro_batch[1].numel()
            counted["tokens"] += int(micro_batch[1].sum())
        return {**counted, "sample": sample}


class PeakRss:
    """The driver's peak resident memory while the `with` block runs (sampled every 20 ms)."""

    def __enter__(self) -> PeakRss:
        self.process = psutil.Process()
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / 2**20


def _padding(rows, micro_batches) -> float:
    slots = sum(b[1].numel() for b in micro_batches)
    return 1.0 - sum(len(ids) for ids, _ in rows) / slots


def _ingest(path: Path, model_path: str, vocab_size: int, consumers: int,
            tokenize_workers: int) -> list[dict]:
    """The job's path over one file: counting pass on the driver, shards to consumers."""
    rows = tokenized(read_chats(str(path), 0, 0.25), model_path, 2048, vocab_size, "truncate",
                     0.5, tokenize_workers)
    _, statuses, _, _ = count_answers(rows, (), vocab_size)
    shards = training_rows(rows, ()).streaming_split(consumers, equal=False)
    results = ray.get([Consumer.remote().consume.remote(s) for s in shards])
    delivered = sum(r["rows"] for r in results)
    assert delivered == sum(statuses.values()), (delivered, statuses)
    return results


def run(model_path: str, sizes: tuple[int, ...] = (10_000, 100_000), consumers: int = 2,
        tokenize_workers: int = 1, warm_up: int = 500) -> None:
    """Emit conversations/s and driver peak RSS per size, their ratio, and the padding ratio
    (`warm_up` conversations first, unmeasured: imports, the tokenizer, Ray Data's actors)."""
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    ray.init(ignore_reinit_error=True, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    peaks, sample = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        if warm_up:
            _ingest(write_multi_turn_chats(Path(tmp) / "warm-up.jsonl", warm_up), model_path,
                    vocab_size, consumers, tokenize_workers)
        for size in sizes:
            path = write_multi_turn_chats(Path(tmp) / f"chats-{size}.jsonl", size)
            started = time.perf_counter()
            with PeakRss() as rss:
                results = _ingest(path, model_path, vocab_size, consumers, tokenize_workers)
            seconds = time.perf_counter() - started
            peaks[size] = rss.growth_mb
            emit("ingest", "conversations_per_s", size / seconds, "conv/s", conversations=size,
                 micro_batches=sum(r["micro_batches"] for r in results),
                 padding_share=1 - sum(r["tokens"] for r in results)
                 / sum(r["slots"] for r in results))
            emit("ingest", "driver_peak_rss_growth", rss.growth_mb, "MiB", conversations=size)
            sample = [row for r in results for row in r["sample"]]
    smallest, largest = min(sizes), max(sizes)
    growth = peaks[largest] / max(peaks[smallest], 1.0)
    emit("ingest", "driver_peak_rss_growth_ratio", growth, "ratio",
         baseline=f"{smallest} conversations", ratio=round(growth, 3), conversations=largest,
         note=f"1.0 = flat; the dataset grew {largest / smallest:.0f}x")
    budget = list(token_budget_micro_batches(sample, MAX_TOKENS, MAX_ROWS, WINDOW))
    fixed = make_micro_batches(sample, MAX_ROWS)
    budget_padding, fixed_padding = _padding(sample, budget), _padding(sample, fixed)
    emit("ingest", "padding_share_token_budget", budget_padding, "share", rows=len(sample),
         micro_batches=len(budget))
    emit("ingest", "padding_share_fixed_rows", fixed_padding, "share", rows=len(sample),
         micro_batches=len(fixed))
    padding_ratio = budget_padding / fixed_padding
    emit("ingest", "padding_ratio", padding_ratio, "ratio",
         baseline="fixed rows per micro-batch (shuffled)", ratio=round(padding_ratio, 3))
    ray.shutdown()
