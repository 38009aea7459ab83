"""The shift of docs/contract.md on a worked example small enough to check by eye."""

import pytest
import torch

from eagle_ray.backends.base import shift_supervision


def test_shift_on_a_hand_written_example():
    # Row 0: x = [10, 11, 12, 13] + one pad; answer tokens are x2, x3.
    # Row 1: x = [20, 21] + three pads; answer token x1.
    input_ids = torch.tensor([[10, 11, 12, 13, 0], [20, 21, 0, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]])
    # Hidden value at (row b, position t) = 100 * b + t + 1, so shifts are visible.
    position_value = (100 * torch.arange(2)[:, None] + torch.arange(5)[None, :] + 1).float()
    aux = position_value[..., None].repeat(1, 1, 6)  # [2, 5, 3H] with H = 2
    last = -position_value[..., None].repeat(1, 1, 2)  # [2, 5, H]

    out = shift_supervision(input_ids, attention_mask, loss_mask, aux, last)

    assert out["input_ids"].tolist() == [[11, 12, 13, 0, 0], [21, 0, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == attention_mask.tolist()
    # aux is not shifted; pads are zero.
    assert out["aux_hidden_states"][..., 0].tolist() == [[1, 2, 3, 4, 0], [101, 102, 0, 0, 0]]
    # last hidden at slot t is the target's state at t + 1; slots with no t + 1 are zero.
    assert out["last_hidden"][..., 0].tolist() == [[-2, -3, -4, 0, 0], [-102, 0, 0, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_as_an_engine_captured_them_shift_exactly_as_padded_states(dtype):
    """vLLM hands each request's states back on their own (`[n, 3 + 1, H]`: the aux layers,
    then the final state); shifting them straight into the batch gives, bit for bit, what the
    padded states give, on every slot (garbage at the padded states' pad positions included)."""
    from eagle_ray.contract.shift import shift_captured_rows
    from eagle_ray.testing import random_micro_batch

    ids, attention_mask, loss_mask = random_micro_batch(100, (7, 1, 12, 3), seed=2)
    batch, seq, hidden = *ids.shape, 5
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(int(n), 4, hidden, generator=generator).to(dtype)
            for n in attention_mask.sum(dim=1)]
    aux = torch.randn(batch, seq, 3 * hidden, generator=generator).to(dtype)  # garbage at pads
    last = torch.randn(batch, seq, hidden, generator=generator).to(dtype)
    for row, states in enumerate(rows):
        aux[row, :len(states)] = states[:, :3].reshape(len(states), 3 * hidden)
        last[row, :len(states)] = states[:, 3]

    got = shift_captured_rows(ids, attention_mask, loss_mask, rows)
    expected = shift_supervision(ids, attention_mask, loss_mask, aux, last)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
