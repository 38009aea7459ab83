"""Comparing a backend's supervision with the HF reference's, slot by slot."""

import torch

# fp32 on CPU: measured max abs difference ~1e-5 against HF (different kernels, same math).
FP32_ATOL = 5e-5


def assert_matches_reference(batch, reference, head, atol=FP32_ATOL):
    assert batch.aux_hidden_states.dtype == reference.aux_hidden_states.dtype
    assert batch.num_aux_layers == reference.num_aux_layers
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(batch.tensors()[name], reference.tensors()[name]), name
    torch.testing.assert_close(batch.aux_hidden_states, reference.aux_hidden_states,
                               rtol=0, atol=atol)
    torch.testing.assert_close(batch.last_hidden, reference.last_hidden, rtol=0, atol=atol)
    logits, reference_logits = head(batch.last_hidden), head(reference.last_hidden)
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=atol)
    has_next = reference.attention_mask.bool().roll(-1, 1)
    has_next[:, -1] = False
    assert torch.equal(logits.argmax(-1)[has_next], reference_logits.argmax(-1)[has_next])
