"""Hypothesis strategies for hostile micro-batches: a valid batch with random mutations applied
(wrong dtypes, shapes, ids out of range, masks that disagree, empty rows, left padding, loss on
padding, absurd lengths, not tensors at all)."""

import numpy as np
import torch
from hypothesis import strategies as st

from eagle_ray.testing import random_micro_batch

MUTATIONS = ("ids_dtype", "mask_dtype", "flatten", "add_dim", "empty", "id_too_large",
             "id_negative", "mask_shape", "mask_value", "empty_row", "left_pad", "loss_on_pad",
             "absurd_length", "numpy_ids", "list_ids")


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
def hostile_micro_batches(draw, vocab_size: int, max_length: int):
    """`(input_ids, attention_mask, loss_mask)` after one or two random mutations."""
    lengths = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=4)))
    batch = random_micro_batch(vocab_size, lengths, seed=draw(st.integers(0, 2**16)))
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2)):
        try:
            batch = mutate(batch, mutation, draw, vocab_size, max_length)
        except (IndexError, RuntimeError, TypeError, AttributeError):
            pass  # a second mutation that does not apply to what the first one made
    return batch


def as_replica_inputs(batch):
    """What a caller that bypasses the client sends a replica: arrays, or whatever it has."""
    return tuple(np.asarray(t) if isinstance(t, torch.Tensor) else t for t in batch)
