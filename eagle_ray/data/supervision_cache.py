"""The offline supervision cache: a pool's supervision for a dataset, on disk, read back by
training instead of calling the pool (docs/training.md, "Supervision cache").

A cache is a folder of safetensors shards and an `index.json` written last (its presence marks a
complete cache). Each micro-batch `k` is stored as tensors named `<k>.<field>`: the shifted ids
and masks, the aux states and `last_hidden` (the compact encoding: H values per token, not V),
in the engine's dtype or, with `encoding_dtype: fp8`, as e4m3 values plus `<k>.<field>.scale`.
The index records the target's identity (checkpoint fingerprint, aux ids), the draft
vocabulary, the held-out conversations and the data counts, so training from a cache needs
neither the pool nor the data, and a cache made by another target or other aux ids is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle_ray.config import ConfigError, PoolConfig
from eagle_ray.contract.fp8 import dequantize_fp8, encode_batch
from eagle_ray.contract.identity import TargetIdentity, check_job_target
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_batch import Eagle3TargetBatch

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
FORMAT_VERSION = 1
SHARD_BYTES = 512 * 2**20  # a shard is closed once it holds this much
BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Eagle3TargetBatch))


class SupervisionCacheWriter:
    """Appends micro-batches' supervision to shards; `close(...)` writes the index."""

    def __init__(self, path: str | Path, served: TargetIdentity, encoding_dtype: str = "auto",
                 shard_bytes: int = SHARD_BYTES) -> None:
        self.path = Path(path)
        if (self.path / INDEX_FILE).exists():
            raise FileExistsError(f"{self.path} already holds a supervision cache; remove it or "
                                  f"choose another data.supervision_cache")
        self.path.mkdir(parents=True, exist_ok=True)
        self.served, self.encoding_dtype, self.shard_bytes = served, encoding_dtype, shard_bytes
        self.micro_batches: list[dict[str, Any]] = []  # shard, tokens per micro-batch
        self.shards: list[dict[str, Any]] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self.hidden_dtype = ""  # what fp8 values are dequantised into

    def add(self, batch: Eagle3TargetBatch) -> None:
        key = len(self.micro_batches)
        self.hidden_dtype = str(batch.aux_hidden_states.dtype).removeprefix("torch.")
        for name, values, scales, _ in encode_batch(batch, self.encoding_dtype):
            if scales is not None:
                self._stage(f"{key}.{name}.scale", scales)
            self._stage(f"{key}.{name}", values)
        self.micro_batches.append({"shard": len(self.shards),
                                   "tokens": int(batch.attention_mask.sum())})
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _stage(self, name: str, tensor: torch.Tensor) -> None:
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += tensor.numel() * tensor.element_size()

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self._pending, str(self.path / name))
        self.shards.append({"file": name, "bytes": self._pending_bytes})
        self._pending, self._pending_bytes = {}, 0

    def close(self, vocab: DraftVocab, held_out: list, statuses: dict[str, int]) -> dict:
        """Write the last shard and the index (atomically: a reader sees all or nothing)."""
        self._flush()
        tokens = sum(m["tokens"] for m in self.micro_batches)
        index = {
            "format": FORMAT_VERSION,
            "target": self.served.to_dict(),
            "encoding_dtype": self.encoding_dtype,
            "hidden_dtype": self.hidden_dtype,
            "draft_vocab": {"draft_to_target": vocab.draft_to_target.tolist(),
                            "target_vocab_size": vocab.target_vocab_size},
            "held_out": held_out,
            "statuses": statuses,
            "tokens": tokens,
            "bytes": sum(s["bytes"] for s in self.shards),
            "shards": self.shards,
            "micro_batches": self.micro_batches,
        }
        partial = self.path / f"{INDEX_FILE}.partial"
        partial.write_text(json.dumps(index))
        os.replace(partial, self.path / INDEX_FILE)
        logger.info("supervision cache %s: %d micro-batches, %d tokens, %.1f MiB in %d shards "
                    "(%s)", self.path, len(self.micro_batches), tokens,
                    index["bytes"] / 2**20, len(self.shards), self.encoding_dtype)
        return index


class SupervisionCache:
    """A complete cache, opened for reading (`open`)."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index
        self._open_shards: dict[int, tuple[Any, set[str]]] = {}  # shard -> reader, its names

    @classmethod
    def open(cls, path: str | Path) -> SupervisionCache:
        path = Path(path)
        if not (path / INDEX_FILE).exists():
            raise ConfigError(f"data.supervision_cache {str(path)!r} holds no complete "
                              f"supervision cache ({INDEX_FILE} missing); write one first with "
                              f"`eagle-ray cache --config JOB.yaml`")
        index = json.loads((path / INDEX_FILE).read_text())
        if index.get("format") != FORMAT_VERSION:
            raise ConfigError(f"{path} is a supervision cache of format {index.get('format')}, "
                              f"this eagle_ray reads format {FORMAT_VERSION}; write it again")
        return cls(path, index)

    @property
    def identity(self) -> TargetIdentity:
        return TargetIdentity.from_dict(self.index["target"])

    @property
    def draft_vocab(self) -> DraftVocab:
        vocab = self.index["draft_vocab"]
        return DraftVocab(torch.tensor(vocab["draft_to_target"], dtype=torch.int64),
                          vocab["target_vocab_size"])

    def check_target(self, target: PoolConfig) -> None:
        """Refuse a cache made by another target or other aux ids than the job's."""
        check_job_target(target, self.identity, source=f"the supervision cache {self.path}")

    def __len__(self) -> int:
        return len(self.index["micro_batches"])

    def read(self, key: int) -> Eagle3TargetBatch:
        """Micro-batch `key`, dequantised to the engine's dtype if stored as fp8."""
        shard = self.index["micro_batches"][key]["shard"]
        if shard not in self._open_shards:
            reader = safe_open(str(self.path / self.index["shards"][shard]["file"]),
                               framework="pt")
            self._open_shards[shard] = reader, set(reader.keys())
        reader, names = self._open_shards[shard]
        tensors = {}
        for field in BATCH_FIELDS:
            name = f"{key}.{field}"
            if name not in names:
                continue
            tensor = reader.get_tensor(name)
            if f"{name}.scale" in names:
                tensor = dequantize_fp8(tensor, reader.get_tensor(f"{name}.scale"),
                                        getattr(torch, self.index["hidden_dtype"]))
            tensors[field] = tensor
        return Eagle3TargetBatch(**tensors, num_aux_layers=len(self.identity.aux_layer_ids))

    def stream(self, rank: int = 0, world: int = 1, seed: int = 0) -> Iterator[Eagle3TargetBatch]:
        """Worker `rank` of `world`'s micro-batches (every `world`-th), epoch after epoch, each
        epoch in its own seeded order."""
        mine = list(range(rank, len(self), world))
        if not mine:
            raise RuntimeError(f"worker {rank} has no micro-batches: the supervision cache holds "
                               f"{len(self)}, fewer than the {world} workers")
        for epoch in itertools.count():
            order = mine.copy()
            random.Random(seed * 1000 + epoch).shuffle(order)
            for key in order:
                yield self.read(key)
