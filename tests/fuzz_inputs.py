"""Hypothesis strategies for hostile micro-batches: a valid batch with random mutations applied
(wrong dtypes, shapes, ids out of range, masks that disagree, empty rows, left padding, loss on
padding, absurd lengths, not tensors at all), with an oracle: whether the result is valid by the
contract (`is_valid`, written from docs/contract.md independently of the validator), and what
the validator must say for each mutation that took (`EXPECTED`)."""

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from eagle_ray.testing import random_micro_batch

MUTATIONS = ("ids_dtype", "mask_dtype", "flatten", "add_dim", "empty", "id_too_large",
             "id_negative", "mask_shape", "mask_value", "empty_row", "left_pad", "loss_on_pad",
             "absurd_length", "numpy_ids", "list_ids")


# What the validator says about each mutation: (error type, words its message must hold).
EXPECTED = {
    "ids_dtype": (TypeError, "input_ids must hold integer token ids"),
    "mask_dtype": (TypeError, "attention_mask must be an integer or bool tensor"),
    "flatten": (ValueError, "must be 2-D"),
    "add_dim": (ValueError, "must be 2-D"),
    "empty": (ValueError, "empty micro-batch"),
    "id_too_large": (ValueError, "token ids must be in [0, "),
    "id_negative": (ValueError, "token ids must be in [0, "),
    "mask_shape": (ValueError, "attention_mask shape"),
    "mask_value": (ValueError, "attention_mask must hold only 0 and 1"),
    "empty_row": (ValueError, "have no tokens"),
    "left_pad": (ValueError, "must be right-padded"),
    "loss_on_pad": (ValueError, "loss_mask is set on padding"),
    "absurd_length": (ValueError, "tokens but the target accepts at most"),
    "numpy_ids": (TypeError, "input_ids must be a torch.Tensor"),
    "list_ids": (TypeError, "input_ids must be a torch.Tensor"),
}
REPLACING = ("empty", "absurd_length")  # build a new batch: earlier mutations are gone


@dataclasses.dataclass(frozen=True)
class Hostile:
    """A generated micro-batch, the mutations that took, and the oracle's verdict."""

    batch: tuple
    mutations: tuple[str, ...]
    vocab_size: int
    max_length: int

    @property
    def valid(self) -> bool:
        return is_valid(self.batch, self.vocab_size, self.max_length)

    def explains(self, error: Exception) -> bool:
        """Whether `error` is of the kind, and says the words, the mutation calls for; after two
        mutations (which can break a batch in a third way: a flattened batch given a new first
        dimension has holes in its mask), one of the validator's documented errors."""
        expected = [EXPECTED[m] for m in self.mutations] if len(self.mutations) == 1 \
            else EXPECTED.values()
        return any(isinstance(error, kind) and words in str(error) for kind, words in expected)


def is_valid(batch, vocab_size: int, max_length: int) -> bool:
    """The contract's rule for a micro-batch, checked plainly: three integer tensors of one 2-D
    non-empty shape, 0/1 masks, every row right-padded with at least one token and at most
    `max_length`, loss only on attended slots, attended ids inside the vocabulary."""
    ids, attention, loss = batch
    if not all(isinstance(t, torch.Tensor) for t in batch):
        return False
    integer = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    if ids.dtype not in integer or any(m.dtype not in (*integer, torch.bool)
                                       for m in (attention, loss)):
        return False
    if ids.dim() != 2 or ids.numel() == 0 or attention.shape != ids.shape \
            or loss.shape != ids.shape:
        return False
    if any(((m != 0) & (m != 1)).any() for m in (attention, loss)):
        return False
    lengths = attention.long().sum(1)
    right_padded = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    if (lengths == 0).any() or not torch.equal(right_padded, attention.bool()) \
            or int(lengths.max()) > max_length or (loss.bool() & ~attention.bool()).any():
        return False
    real = ids[attention.bool()]
    return bool(((real >= 0) & (real < vocab_size)).all())


def mutate(batch, mutation: str, draw, vocab_size: int, max_length: int):
    ids, attention, loss = (t.clone() if isinstance(t, torch.Tensor) else t for t in batch)
    if mutation == "ids_dtype":
        ids = ids.to(draw(st.sampled_from([torch.float32, torch.float16, torch.bool,
                                           torch.complex64])))
    elif mutation == "mask_dtype":
        attention = attention.to(draw(st.sampled_from([torch.float32, torch.complex64])))
    elif mutation == "flatten":
        ids, attention, loss = ids.flatten(), attention.flatten(), loss.flatten()
    elif mutation == "add_dim":
        ids, attention, loss = ids[None], attention[None], loss[None]
    elif mutation == "empty":
        rows = draw(st.sampled_from([(0, ids.shape[1]), (ids.shape[0], 0), (0, 0)]))
        ids, attention, loss = (torch.zeros(rows, dtype=torch.long) for _ in range(3))
    elif mutation == "id_too_large":
        ids[0, 0] = vocab_size + draw(st.integers(0, 10**9))
    elif mutation == "id_negative":
        ids[0, 0] = -draw(st.integers(1, 10**9))
    elif mutation == "mask_shape":
        attention = attention[:, : draw(st.integers(0, attention.shape[1] - 1))]
    elif mutation == "mask_value":
        attention[0, 0] = draw(st.sampled_from([2, -1, 7]))
    elif mutation == "empty_row":
        attention[draw(st.integers(0, attention.shape[0] - 1))] = 0
        loss = loss * attention
    elif mutation == "left_pad":
        attention, loss = attention.flip(1), torch.zeros_like(loss)
    elif mutation == "loss_on_pad":
        loss = torch.ones_like(loss)
    elif mutation == "absurd_length":
        n = max_length + draw(st.integers(1, 4 * max_length))
        ids = torch.randint(1, vocab_size, (1, n))
        attention, loss = torch.ones_like(ids), torch.ones_like(ids)
    elif mutation == "numpy_ids":
        ids = ids.numpy()
    elif mutation == "list_ids":
        ids = ids.tolist()
    return ids, attention, loss


@st.composite
def hostile_micro_batches(draw, vocab_size: int, max_length: int) -> Hostile:
    """A valid micro-batch after one or two different random mutations (`Hostile`)."""
    lengths = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=4)))
    batch = random_micro_batch(vocab_size, lengths, seed=draw(st.integers(0, 2**16)))
    took: list[str] = []
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2,
                                  unique=True)):
        try:
            batch = mutate(batch, mutation, draw, vocab_size, max_length)
        except (IndexError, RuntimeError, TypeError, AttributeError):
            continue  # a second mutation that does not apply to what the first one made
        took = [mutation] if mutation in REPLACING else [*took, mutation]
    return Hostile(batch, tuple(took), vocab_size, max_length)


def as_replica_inputs(batch):
    """What a caller that bypasses the client sends a replica: arrays, or whatever it has."""
    return tuple(np.asarray(t) if isinstance(t, torch.Tensor) else t for t in batch)


def valid_at_a_replica(hostile: Hostile) -> bool:
    """A replica takes arrays (it makes tensors of them, as `micro_batch_tensors` does): the
    batch is valid there when that works and the tensors are valid."""
    try:
        tensors = tuple(torch.tensor(a) for a in as_replica_inputs(hostile.batch))
    except (TypeError, ValueError, RuntimeError):
        return False
    return is_valid(tensors, hostile.vocab_size, hostile.max_length)
