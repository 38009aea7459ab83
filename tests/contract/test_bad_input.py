"""Bad micro-batches get a clear error before any engine sees them. (That an engine keeps serving
correctly after bad input is checked where there is state: the vLLM engine in
test_vllm_target.py, a replica in test_pool_vllm.py.)"""

import pytest
import torch

from eagle_ray.backends.base import Eagle3TargetBatch
from eagle_ray.testing import random_micro_batch


@pytest.fixture
def good(hf_llama):
    return random_micro_batch(hf_llama.vocab_size, (6, 4))


def test_float_token_ids(hf_llama, good):
    ids, attn, loss = good
    with pytest.raises(TypeError, match=r"integer token ids.*\.long\(\)"):
        hf_llama.generate_batch(ids.float(), attn, loss)


def test_one_dimensional_input(hf_llama, good):
    ids, attn, loss = good
    with pytest.raises(ValueError, match=r"2-D.*unsqueeze\(0\)"):
        hf_llama.generate_batch(ids[0], attn[0], loss[0])


def test_mismatched_mask_shapes(hf_llama, good):
    ids, attn, loss = good
    with pytest.raises(ValueError, match="attention_mask shape"):
        hf_llama.generate_batch(ids, attn[:, :-1], loss)
    with pytest.raises(ValueError, match="loss_mask shape"):
        hf_llama.generate_batch(ids, attn, loss[:1])


def test_ids_outside_the_vocabulary(hf_llama, good):
    ids, attn, loss = good
    ids = ids.clone()
    ids[1, 2] = hf_llama.vocab_size
    with pytest.raises(ValueError, match=rf"\[0, {hf_llama.vocab_size}\).*{hf_llama.vocab_size}"):
        hf_llama.generate_batch(ids, attn, loss)
    ids[1, 2] = -1
    with pytest.raises(ValueError, match="target's vocabulary"):
        hf_llama.generate_batch(ids, attn, loss)


def test_empty_batch(hf_llama):
    empty = torch.zeros(0, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="empty micro-batch"):
        hf_llama.generate_batch(empty, empty, empty)


def test_left_padding_and_empty_rows(hf_llama, good):
    ids, attn, loss = good
    with pytest.raises(ValueError, match="right-padded"):
        hf_llama.generate_batch(ids, attn.flip(1), torch.zeros_like(loss))
    attn = attn.clone()
    attn[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have no tokens"):
        hf_llama.generate_batch(ids, attn, torch.zeros_like(loss))


def test_loss_on_padding(hf_llama, good):
    ids, attn, loss = good
    loss = loss.clone()
    loss[1, -1] = 1
    with pytest.raises(ValueError, match="loss_mask is set on padding"):
        hf_llama.generate_batch(ids, attn, loss)


def test_float_masks(hf_llama, good):
    ids, attn, loss = good
    with pytest.raises(TypeError, match="attention_mask must be an integer or bool"):
        hf_llama.generate_batch(ids, attn.float(), loss)


def test_rows_longer_than_the_target_allows(hf_llama):
    n = hf_llama.max_length + 1
    ids = torch.full((1, n), 5)
    with pytest.raises(ValueError, match=f"{n} tokens.*at most {hf_llama.max_length}"):
        hf_llama.generate_batch(ids, torch.ones_like(ids), torch.ones_like(ids))


def test_unknown_encoding(hf_llama, good):
    with pytest.raises(ValueError, match="unknown target encoding 'probs'"):
        hf_llama.generate_batch(*good, encoding="probs")


def test_batch_type_rejects_two_encodings_and_bad_shapes():
    ids = torch.zeros(2, 3, dtype=torch.long)
    aux = torch.zeros(2, 3, 12)
    with pytest.raises(ValueError, match="exactly one target encoding"):
        Eagle3TargetBatch(aux, ids, ids, ids, logits=torch.zeros(2, 3, 9),
                          last_hidden=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="hidden size 4"):
        Eagle3TargetBatch(aux, ids, ids, ids, last_hidden=torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="position_mask must be a bool tensor"):
        Eagle3TargetBatch(aux, ids, ids, ids, target_probs=torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match=r"input_ids must be an integer or bool tensor \[2, 3\]"):
        Eagle3TargetBatch(aux, ids.float(), ids, ids, last_hidden=torch.zeros(2, 3, 4))
