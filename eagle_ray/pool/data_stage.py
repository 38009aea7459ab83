"""The pool as a library (docs/library.md): what a user's own Ray code needs beside `TargetPool`
and `PoolClient` -- the draft's check of what the pool serves (`expect_target`), a client window
sized against the pool (`window_config`, `size_window`), and supervision as a Ray Data stage
(`SupervisionStage`, `map_supervision`) with an idempotent keyed writer for offline caches
(`write_supervision_rows`, read back by `SupervisionRows`).

Exactly once through Ray Data. Ray Data re-executes a block when the actor or task that held it
dies (and on lineage reconstruction), so a stage must not turn re-execution into duplicates:

1. Every input row carries a stable, unique `key` (a content hash, a row id from the source);
   the stage refuses rows without one. Output rows carry their input row's key.
2. The output is a function of the input row alone: rows are packed into micro-batches in the
   order they arrive, and each row's supervision is cut back out of its micro-batch unpadded.
   The contract zeroes every slot without a next position, so the cut does not depend on the
   neighbours; where the engine computes rows independently (vLLM: tested bit for bit merged or
   alone; HF within float precision), a re-executed row equals the first bit for bit. Inside
   one execution the client delivers every micro-batch once, in order.
3. The writer dedups by key: row `key` goes to one file named by the key, written under a
   temporary name and renamed into place (never a torn file), and skipped when it exists. A
   re-executed block writes nothing new (`written: False`); two executions racing on one key
   leave one complete file. The folder holds exactly one row per key, whatever ran twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from eagle_ray.config.loader import ConfigError
from eagle_ray.config.pool import ClientConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool.states import ReplicaState

if TYPE_CHECKING:
    import ray.data

    from eagle_ray.pool.pool import TargetPool

logger = logging.getLogger(__name__)

IDENTITY_FILE = "identity.json"
ROW_FIELDS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden", "logits",
              "target_probs", "position_mask")  # a row's record: every field but attention_mask
_SAFE_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


# ---------------------------------------------------------------- what the draft expects


def expect_target(served: TargetIdentity, *, fingerprint: str | None = None,
                  aux_layer_ids: Sequence[int] | None = None, hidden_size: int | None = None,
                  vocab_size: int | None = None, dtype: str | None = None) -> None:
    """Raise `ConfigError` unless the pool serves what the draft was built for.

    Each argument left None is not checked. `fingerprint`: `checkpoint_fingerprint(path)` of the
    target checkpoint (or the one an exported draft records); `aux_layer_ids`: canonical
    (post-layer) ids; `hidden_size`, `vocab_size`: what the draft's input layer and vocabulary
    mapping were sized for; `dtype`: e.g. "bfloat16".
    """
    expected = {"fingerprint": fingerprint, "aux_layer_ids": aux_layer_ids,
                "hidden_size": hidden_size, "vocab_size": vocab_size, "dtype": dtype}
    problems = []
    for name, want in expected.items():
        have = getattr(served, name)
        if want is None:
            continue
        if name == "aux_layer_ids":
            want, have = list(want), list(have)
        if want != have:
            problems.append(f"{name} {want} (the pool serves {have})")
    if problems:
        raise ConfigError(
            f"the pool serves {served.describe()}, but the draft expects " + "; ".join(problems)
            + ". Supervision from another target trains a draft that target would not accept: "
            "connect to a pool serving the draft's target, or start one with matching "
            "PoolConfig(model_path=..., aux_layer_ids=...).")


# ---------------------------------------------------------------- the client's window


def supervision_bytes_per_token(served: TargetIdentity) -> int:
    """Bytes of one token's supervision as a client holds it: the aux states (3H) and the
    encoding (H for `last_hidden`, V for `logits`) in the engine's dtype, and int64 ids and
    masks (fp8 travels as bytes but is dequantised on read, so it is counted in `dtype`)."""
    width = 3 * served.hidden_size + (
        served.hidden_size if served.encoding == "last_hidden" else served.vocab_size)
    item = torch.empty((), dtype=getattr(torch, served.dtype)).element_size()
    return width * item + 3 * 8


def window_config(tokens_per_micro_batch: int, *, replicas: int, max_tokens_per_engine_call: int,
                  max_outstanding_tokens_per_replica: int, bytes_per_token: int,
                  clients: int = 1, memory_budget_bytes: int | None = None,
                  base: ClientConfig | None = None) -> ClientConfig:
    """A client's window (`max_inflight_micro_batches`, `max_inflight_tokens`) for this pool.

    The window's tokens are the least of: what keeps the replicas this client may use busy (two
    merged engine calls each: one running, the next waiting; `clients` share the replicas), the
    client's share of what the router lets the pool hold at once (`replicas` x
    `max_outstanding_tokens_per_replica` / `clients`: more only waits at the router), and the
    results that fit `memory_budget_bytes` (the window holds at most that much supervision);
    never less than one micro-batch. Other fields come from `base`.

    Raises:
        ValueError: a count below 1, or one micro-batch's supervision alone over the budget.
    """
    counts = {"tokens_per_micro_batch": tokens_per_micro_batch, "replicas": replicas,
              "max_tokens_per_engine_call": max_tokens_per_engine_call, "clients": clients,
              "max_outstanding_tokens_per_replica": max_outstanding_tokens_per_replica,
              "bytes_per_token": bytes_per_token}
    low = [f"{name}={value}" for name, value in counts.items() if value < 1]
    if low:
        raise ValueError(f"window_config needs counts >= 1, got {', '.join(low)}")
    feed = 2 * max_tokens_per_engine_call * math.ceil(replicas / clients)
    share = replicas * max_outstanding_tokens_per_replica // clients
    tokens = min(feed, share)
    if memory_budget_bytes is not None:
        fits = memory_budget_bytes // bytes_per_token
        if fits < tokens_per_micro_batch:
            raise ValueError(
                f"one micro-batch of {tokens_per_micro_batch} tokens holds "
                f"{tokens_per_micro_batch * bytes_per_token} bytes of supervision, over "
                f"memory_budget_bytes={memory_budget_bytes}: send smaller micro-batches")
        tokens = min(tokens, fits)
    micro_batches = max(1, tokens // tokens_per_micro_batch)
    return dataclasses.replace(base or ClientConfig(), max_inflight_micro_batches=micro_batches,
                               max_inflight_tokens=micro_batches * tokens_per_micro_batch)


def size_window(pool: TargetPool, tokens_per_micro_batch: int, *, clients: int = 1,
                memory_budget_bytes: int | None = None, replicas: int | None = None,
                max_outstanding_tokens_per_replica: int | None = None,
                base: ClientConfig | None = None, timeout_s: float = 600.0) -> ClientConfig:
    """`window_config` with the pool's own figures: its replicas now (not failed; `replicas`
    for an autoscaled pool's target), a ready replica's `max_tokens_per_engine_call` and
    identity (waits up to `timeout_s` for one), and `pool.config`'s router cap (an attached
    pool's too: `TargetPool.connect` reads the config the pool was created with)."""
    import ray

    info = ray.get(pool.router.target_info.remote(timeout_s))
    if replicas is None:
        status = pool.pool_status().replicas.values()
        replicas = max(1, sum(r.state is not ReplicaState.FAILED for r in status))
    cap = max_outstanding_tokens_per_replica or pool.config.max_outstanding_tokens_per_replica
    return window_config(tokens_per_micro_batch, replicas=replicas,
                         max_tokens_per_engine_call=info.max_tokens_per_engine_call,
                         max_outstanding_tokens_per_replica=cap,
                         bytes_per_token=supervision_bytes_per_token(info.identity),
                         clients=clients, memory_budget_bytes=memory_budget_bytes, base=base)


# ---------------------------------------------------------------- the Ray Data stage


def pack_rows(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Row indices in arrival order, grouped into micro-batches of at most `max_rows` rows and
    `max_tokens` padded slots (rows x longest); a longer row goes alone. Deterministic."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        wider = max(longest, length)
        if current and (len(current) >= max_rows or wider * (len(current) + 1) > max_tokens):
            groups.append(current)
            current, wider = [], length
        current.append(index)
        longest = wider
    return groups + [current] if current else groups


class SupervisionStage:
    """A Ray Data stage (`ds.map_batches`, actors: each holds one `PoolClient`) that replaces
    token rows by the pool's supervision; build it with `map_supervision`.

    Input rows: `key` (stable and unique), `input_ids` (1-D ints), optionally `loss_mask` (1-D
    0/1; default: all ones). Output rows, one per input row, unpadded (`n` tokens): `key`, the
    record's shifted `input_ids` and `loss_mask` [n], `aux_hidden_states` [n, 3H], the
    encoding (`last_hidden` [n, H] or `logits` [n, V]), and `hidden_dtype` (bf16 values travel
    as their int16 bits). Yielded a micro-batch at a time, so an actor holds at most its
    client's window of results and its input batch.

    Args:
        pool_name, namespace: the pool (strings cross into the actors; clients do not).
        client_config: the window (`size_window(..., clients=concurrency)`).
        max_tokens_per_micro_batch, max_rows_per_micro_batch: how rows are packed.
        expect: `expect_target` keyword arguments, checked as each actor starts.

    Raises (as the actor starts): `ValueError` when no such pool runs, `ConfigError` when it
    serves another target than `expect`; (per batch) `KeyError` for a batch without `key` or
    `input_ids`, `ValueError`/`TypeError` for rows the target refuses, `MicroBatchFailed`.
    """

    def __init__(self, pool_name: str, namespace: str,
                 client_config: ClientConfig | None = None, *,
                 max_tokens_per_micro_batch: int = 4096, max_rows_per_micro_batch: int = 16,
                 expect: dict[str, Any] | None = None) -> None:
        from eagle_ray.pool.client import PoolClient
        from eagle_ray.pool.pool import TargetPool

        if expect:
            expect_target(TargetPool.connect(pool_name, namespace).identity(), **expect)
        self.client = PoolClient.connect(pool_name, namespace, client_config)
        self.max_tokens, self.max_rows = max_tokens_per_micro_batch, max_rows_per_micro_batch

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        return supervise_rows(self.client, batch, self.max_tokens, self.max_rows)


def supervise_rows(client: Any, batch: dict[str, np.ndarray], max_tokens: int, max_rows: int
                   ) -> Iterator[dict[str, np.ndarray]]:
    """The stage's work on one batch: pack the rows (`pack_rows`), stream the micro-batches
    through `client` (anything with `PoolClient.stream`), yield each one's rows (`rows_of`)."""
    keys = batch["key"]
    ids = [np.asarray(row, dtype=np.int64) for row in batch["input_ids"]]
    masks = [np.asarray(row, dtype=np.int64) for row in batch["loss_mask"]] \
        if "loss_mask" in batch else [np.ones_like(row) for row in ids]
    groups = pack_rows([len(row) for row in ids], max_tokens, max_rows)
    inputs = (collate([ids[i] for i in g], [masks[i] for i in g]) for g in groups)
    for group, result in zip(groups, client.stream(inputs), strict=True):
        yield rows_of(result, [keys[i] for i in group], [len(ids[i]) for i in group])


def collate(ids: list[np.ndarray], loss_masks: list[np.ndarray]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids, attention_mask, loss_mask)` of the rows."""
    shape = (len(ids), max(len(row) for row in ids))
    input_ids, attention, loss = (torch.zeros(shape, dtype=torch.long) for _ in range(3))
    for i, (row, mask) in enumerate(zip(ids, loss_masks, strict=True)):
        if len(mask) != len(row):
            raise ValueError(f"row {i}: loss_mask has {len(mask)} values for {len(row)} tokens")
        input_ids[i, :len(row)] = torch.from_numpy(row)
        attention[i, :len(row)] = 1
        loss[i, :len(row)] = torch.from_numpy(mask)
    return input_ids, attention, loss


def rows_of(batch: Eagle3TargetBatch, keys: list[Any], lengths: list[int]
            ) -> dict[str, np.ndarray]:
    """Each row's record cut out of its micro-batch, unpadded, as Ray Data columns."""
    tensors = batch.tensors()
    dtype = str(batch.aux_hidden_states.dtype).removeprefix("torch.")
    columns = {"key": np.array(keys), "hidden_dtype": np.array([dtype] * len(keys))}
    for name in ROW_FIELDS:
        if name in tensors:
            columns[name] = _column([_to_numpy(tensors[name][i, :n])
                                     for i, n in enumerate(lengths)])
    return columns


def map_supervision(ds: ray.data.Dataset, pool_name: str, namespace: str = "eagle_ray", *,
                    window: ClientConfig, concurrency: int = 1,
                    max_tokens_per_micro_batch: int = 4096, max_rows_per_micro_batch: int = 16,
                    expect: dict[str, Any] | None = None, num_cpus: float = 0.5
                    ) -> ray.data.Dataset:
    """`ds` with each row replaced by its supervision (`SupervisionStage`), bounded: a fixed
    pool of `concurrency` actors (size the window with `clients=concurrency`), one batch in
    flight per actor, and batches of twice the window's rows (so an actor refills its window
    within a batch while results stream out a micro-batch at a time; Ray Data pauses the stage,
    and with it the client, when downstream stages fall behind)."""
    import ray.data

    return ds.map_batches(
        SupervisionStage,
        fn_constructor_args=(pool_name, namespace, window),
        fn_constructor_kwargs={"max_tokens_per_micro_batch": max_tokens_per_micro_batch,
                               "max_rows_per_micro_batch": max_rows_per_micro_batch,
                               "expect": expect},
        batch_size=2 * window.max_inflight_micro_batches * max_rows_per_micro_batch,
        compute=ray.data.ActorPoolStrategy(size=concurrency, max_tasks_in_flight_per_actor=1),
        num_cpus=num_cpus, batch_format="numpy")


# ---------------------------------------------------------------- the keyed writer and reader


def write_supervision_rows(batch: dict[str, np.ndarray], path: str,
                           identity: dict[str, Any]) -> dict[str, np.ndarray]:
    """Write each row of a `SupervisionStage` batch to `<path>/<key>.safetensors` unless that
    key is there already (see the module docstring: exactly once); use it as
    `ds.map_batches(write_supervision_rows, fn_kwargs={"path": ..., "identity":
    served.to_dict()})`. Returns `key` and `written` (False: the key was already written).

    Raises `ConfigError` when the folder holds another target's supervision (its
    `identity.json`).
    """
    from safetensors.torch import save_file

    folder = Path(path)
    _claim(folder, TargetIdentity.from_dict(identity))
    written = []
    for i, key in enumerate(batch["key"]):
        target = folder / f"{_file_stem(key)}.safetensors"
        if target.exists():
            written.append(False)
            continue
        dtype = getattr(torch, str(batch["hidden_dtype"][i]))
        tensors = {name: _from_numpy(batch[name][i], dtype) for name in ROW_FIELDS
                   if name in batch}
        partial = folder / f".{target.name}.{uuid.uuid4().hex}.partial"
        save_file(tensors, str(partial), metadata={"key": str(key)})
        os.replace(partial, target)
        written.append(True)
    return {"key": np.asarray(batch["key"]), "written": np.array(written, dtype=bool)}


class SupervisionRows:
    """A folder written by `write_supervision_rows`: one row per key, and the target's
    identity. `read(key)` gives the row as an `Eagle3TargetBatch` of one row (attention all
    ones), as the pool served it (contract dtypes: hidden states in `identity.dtype`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / IDENTITY_FILE).exists():
            raise FileNotFoundError(f"{self.path} holds no supervision rows (no {IDENTITY_FILE})")
        self.identity = TargetIdentity.from_dict(
            json.loads((self.path / IDENTITY_FILE).read_text()))

    def keys(self) -> list[str]:
        from safetensors import safe_open

        keys = []
        for file in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                keys.append(f.metadata()["key"])
        return keys

    def __len__(self) -> int:
        return len(list(self.path.glob("*.safetensors")))

    def read(self, key: Any) -> Eagle3TargetBatch:
        from safetensors.torch import load_file

        file = self.path / f"{_file_stem(key)}.safetensors"
        if not file.exists():
            raise KeyError(f"no supervision row {key!r} in {self.path}")
        tensors = {name: t.unsqueeze(0) for name, t in load_file(str(file)).items()}
        tensors["attention_mask"] = torch.ones_like(tensors["input_ids"])
        return Eagle3TargetBatch(**tensors, num_aux_layers=len(self.identity.aux_layer_ids))


def _claim(folder: Path, served: TargetIdentity) -> None:
    """Mark the folder as this target's (first writer), or refuse another target's."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / IDENTITY_FILE
    if not marker.exists():
        partial = folder / f".{IDENTITY_FILE}.{uuid.uuid4().hex}.partial"
        partial.write_text(json.dumps(served.to_dict(), sort_keys=True))
        os.replace(partial, marker)
    held = TargetIdentity.from_dict(json.loads(marker.read_text()))
    if held != served:
        raise ConfigError(f"{folder} holds supervision of {held.describe()}, not of "
                          f"{served.describe()}: write to another folder")


def _file_stem(key: Any) -> str:
    """The key itself when it is a safe file name, else a hash of it."""
    text = str(key)
    if _SAFE_KEY.fullmatch(text):
        return text
    return "key-" + hashlib.sha256(text.encode()).hexdigest()[:40]


def _column(arrays: list[np.ndarray]) -> np.ndarray:
    """One Ray Data column: stacked when the rows agree in shape, else ragged (objects)."""
    if len({a.shape for a in arrays}) == 1:
        return np.stack(arrays)
    column = np.empty(len(arrays), dtype=object)
    for i, array in enumerate(arrays):
        column[i] = array
    return column


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A copy (results are read-only views of the object store); bf16 as its int16 bits."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().copy()


def _from_numpy(array: np.ndarray, hidden_dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if hidden_dtype == torch.bfloat16 and tensor.dtype == torch.int16:
        return tensor.view(torch.bfloat16)
    return tensor
