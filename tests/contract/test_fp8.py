"""fp8 supervision (`encoding_dtype: fp8`): within the format's bound, half the bytes, and the
draft learns from it as from bf16."""

import pytest
import torch

from eagle_ray.contract.fp8 import ROUND_TRIP_BOUND, dequantize_fp8, quantize_fp8
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss
from eagle_ray.pool.transport import batch_from_numpy, batch_to_numpy
from eagle_ray.testing import random_micro_batch


def within_bound(x, back, scales, group):
    relative, absolute = ROUND_TRIP_BOUND
    per_value_scale = scales.repeat_interleave(group, dim=-1)
    return bool(((x - back).abs() <= relative * x.abs() + absolute * per_value_scale).all())


def test_round_trip_error_stays_within_the_e4m3_bound_at_every_magnitude():
    generator = torch.Generator().manual_seed(0)
    group = 64
    # Tokens whose layers differ by orders of magnitude (massive activations), and a zero row.
    x = torch.randn(4, 9, 3 * group, generator=generator)
    x *= 10.0 ** torch.randint(-3, 4, (4, 9, 3, 1), generator=generator).float().repeat_interleave(
        group, dim=-2).reshape(4, 9, 3 * group)
    x[1, 4] = 0
    values, scales = quantize_fp8(x, group)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (4, 9, 3)
    back = dequantize_fp8(values, scales)
    assert within_bound(x, back, scales, group)
    assert torch.equal(back[1, 4], torch.zeros_like(back[1, 4])), "padding stays zero"
    # The bound is tight enough to mean something: a coarser format would break it.
    coarse = (x / scales.repeat_interleave(group, -1)).round() * scales.repeat_interleave(group, -1)
    assert not within_bound(x, coarse, scales, group)


def test_fp8_payload_carries_half_the_bytes_of_bf16_and_restores_the_dtype(hf_llama):
    batch = hf_llama.generate_batch(*random_micro_batch(hf_llama.vocab_size, (24, 17, 30)))
    bf16 = Eagle3TargetBatch(**{**batch.tensors(),
                                "aux_hidden_states": batch.aux_hidden_states.bfloat16(),
                                "last_hidden": batch.last_hidden.bfloat16()})
    hidden = {"aux_hidden_states", "last_hidden"}
    plain, fp8 = batch_to_numpy(bf16), batch_to_numpy(bf16, "fp8")
    plain_bytes = sum(plain[n][0].nbytes for n in hidden)
    fp8_bytes = sum(sum(a.nbytes for a in fp8[n] if hasattr(a, "nbytes")) for n in hidden)
    values_only = sum(fp8[n][0].nbytes for n in hidden)
    assert values_only * 2 == plain_bytes
    assert fp8_bytes < 0.52 * plain_bytes, "scales add 4 bytes per token and layer"
    back = batch_from_numpy(fp8)
    assert back.aux_hidden_states.dtype == back.last_hidden.dtype == torch.bfloat16
    assert torch.equal(back.input_ids, batch.input_ids)
    _, scales = quantize_fp8(bf16.aux_hidden_states, hf_llama.model.config.hidden_size)
    assert within_bound(bf16.aux_hidden_states.float(), back.aux_hidden_states.float(), scales,
                        hf_llama.model.config.hidden_size)


def test_the_draft_learns_from_fp8_supervision_as_from_bf16(hf_llama):
    vocab = DraftVocab.from_token_counts(torch.arange(hf_llama.vocab_size) % 5 + 1, 128)
    config = DraftConfig.from_target(hf_llama.model.config, vocab.size)
    head = hf_llama.get_target_head()
    batch = hf_llama.generate_batch(*random_micro_batch(hf_llama.vocab_size, (24, 17, 30)))
    payload = batch_to_numpy(Eagle3TargetBatch(**{
        **batch.tensors(), "aux_hidden_states": batch.aux_hidden_states.bfloat16(),
        "last_hidden": batch.last_hidden.bfloat16()}))
    as_bf16, as_fp8 = batch_from_numpy(payload), batch_from_numpy(batch_to_numpy(batch, "fp8"))

    def train(supervision):
        torch.manual_seed(0)
        draft = Eagle3Draft(config, hf_llama.get_input_embeddings().weight.detach())
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad],
                                      lr=3e-3)
        probs, mask = draft_target(supervision, vocab, head)
        losses = []
        for _ in range(20):
            loss, _, _ = ttt_loss(draft, supervision.aux_hidden_states.float(),
                                  supervision.input_ids, supervision.loss_mask, probs, mask,
                                  ttt_steps=3)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    bf16_losses, fp8_losses = train(as_bf16), train(as_fp8)
    assert fp8_losses[-1] < 0.7 * fp8_losses[0], "it learns"
    # The loss is a soft cross-entropy against the head's distribution of each encoding's own
    # last_hidden, so the two curves measure slightly different targets: measured on the kit's
    # random Llama, 1 % apart at the first step and 3-8 % (fp8 lower) after Adam's first
    # update. What must hold: the same start, and fp8 ends as far along as bf16.
    assert fp8_losses[0] == pytest.approx(bf16_losses[0], rel=0.02)
    assert fp8_losses[-1] == pytest.approx(bf16_losses[-1], rel=0.1)
