"""The finiteness check a replica runs before sending supervision (`contract.finite`): it names
every tensor holding NaN or inf, counts each kind exactly and gives the rows; a finite batch, and
a row of finite values whose reduction overflows, pass."""

import pytest
import torch

from eagle_ray.contract.finite import nonfinite_fields, suspect_rows
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool.engine_queue import split_batch

ROWS, SEQ, HIDDEN = 4, 6, 8


def batch(dtype: torch.dtype, encoding: str = "last_hidden") -> Eagle3TargetBatch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (ROWS, SEQ), generator=generator)
    wide = {"last_hidden": HIDDEN, "logits": 50}[encoding]
    return Eagle3TargetBatch(
        aux_hidden_states=torch.randn(ROWS, SEQ, 3 * HIDDEN, generator=generator).to(dtype),
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids),
        **{encoding: torch.randn(ROWS, SEQ, wide, generator=generator).to(dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_non_finite_tensor_is_named_with_its_counts_and_rows(dtype):
    clean = batch(dtype)
    assert nonfinite_fields(clean) == []  # the control: a finite batch passes
    poisoned = batch(dtype)
    aux, last = poisoned.aux_hidden_states, poisoned.last_hidden
    aux[1, 2, :3] = float("nan")
    aux[3, 0, 5] = float("inf")
    aux[3, 5, 7] = -float("inf")
    last[3, 1, 0] = float("nan")
    found = {f.name: f for f in nonfinite_fields(poisoned)}
    assert sorted(found) == ["aux_hidden_states", "last_hidden"]
    aux_found = found["aux_hidden_states"]
    assert (aux_found.rows, aux_found.nan, aux_found.posinf, aux_found.neginf) == ((1, 3), 3, 1, 1)
    assert (found["last_hidden"].rows, found["last_hidden"].nan) == ((3,), 1)
    assert str(found["aux_hidden_states"]) == \
        "aux_hidden_states: 3 NaN, 1 +inf, 1 -inf in row(s) [1, 3]"


def test_the_logits_encoding_is_checked_and_rows_count_within_a_split_micro_batch():
    """A micro-batch split from a merged call (non-contiguous views) gives its own row indices."""
    merged = batch(torch.float32, "logits")
    merged.logits[2, 4, 7] = float("inf")
    parts = [(torch.zeros(2, SEQ - 1),) * 3, (torch.zeros(2, SEQ),) * 3]
    first, second = split_batch(merged, parts)
    assert not first.logits.is_contiguous()
    assert nonfinite_fields(first) == []
    (found,) = nonfinite_fields(second)
    assert (found.name, found.rows, found.posinf) == ("logits", (0,), 1)


@pytest.mark.parametrize("dtype,large", [(torch.bfloat16, 3e38), (torch.float16, 6e4)])
def test_large_finite_values_are_not_refused(dtype, large):
    """Values near the dtype's largest overflow a row's sum (bf16) or would (fp16, checked by
    its extremes); only a real NaN or inf is refused."""
    big = batch(dtype)
    big.aux_hidden_states[0].fill_(large)
    if dtype == torch.bfloat16:  # the reduction flags it; the exact count clears it
        assert suspect_rows(big.aux_hidden_states).tolist() == [True, False, False, False]
    assert nonfinite_fields(big) == []
    big.aux_hidden_states[0, 0, 0] = float("inf")  # the control: one inf among them is refused
    (found,) = nonfinite_fields(big)
    assert (found.rows, found.posinf) == ((0,), 1)
