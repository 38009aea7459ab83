"""The training losses (eagle_ray/contract/losses.py, `train.loss`) and D-PACE's weights against
independent slot-by-slot computations and speculators 0.9's functions, with controls that must
differ; each loss trains. Through the drafts' objectives: tests/draft/test_objectives.py."""

import math

import pytest
import torch

from eagle_ray.contract.losses import (
    LOSSES,
    SlotLoss,
    dpace_weights,
    masked_mean,
    top_token_confidence,
)
from eagle_ray.contract.supervision import soft_cross_entropy

from loss_oracles import (
    dpace_block_weights,
    masked_mean_of_slots,
    slot_values,
    speculators_module,
)

NAMES = list(LOSSES)
ASYMMETRIC = ["forward_kl", "reverse_kl", "lk_hybrid"]  # p and q swapped give another value
# speculators' eager function for each loss (`speculators/losses/eager.py`).
SPECULATORS = {"forward_kl": "kl_div_loss", "reverse_kl": "reverse_kl_div_loss",
               "jensen_shannon": "js_div_loss", "total_variation": "tv_loss",
               "neg_log_acceptance": "neg_log_acceptance_loss", "lk_hybrid": "lk_hybrid_loss"}


def supervision(seed: int = 0, rows: int = 2, seq: int = 6, vocab: int = 9):
    """Draft logits, target probabilities (one slot nearly one-hot, one with zeros beyond fp32's
    range: a target that underflowed) and the two masks."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(rows, seq, vocab, generator=generator)
    target_logits = 2 * torch.randn(rows, seq, vocab, generator=generator)
    target_logits[0, 1, 3] += 12.0
    probs = torch.softmax(target_logits, dim=-1)
    probs[1, 2] = torch.softmax(torch.tensor([0.0, 1.0, -200.0, 2.0, -300.0, 0.5, 0.0, -1.0,
                                              1.5]), dim=-1)
    position_mask = torch.rand(rows, seq, generator=generator) > 0.2
    loss_mask = torch.rand(rows, seq, generator=generator) > 0.2
    loss_mask[1, 2] = position_mask[1, 2] = True
    return logits, probs, position_mask, loss_mask


@pytest.mark.parametrize("name", NAMES)
def test_each_loss_is_its_slot_by_slot_computation(name):
    logits, probs, position_mask, loss_mask = supervision()
    loss = SlotLoss(name, lk_eta=2.0)
    mask = position_mask & loss_mask
    value = float(loss.mean(logits, probs, position_mask, loss_mask))
    # Reverse KL reads log p: the underflowed target's zeros as fp32's smallest normal.
    read = probs.clamp_min(torch.finfo(torch.float32).tiny) if name == "reverse_kl" else probs
    expected = masked_mean_of_slots(name, logits, read, mask, eta=2.0)
    assert math.isfinite(value) and value == pytest.approx(expected, rel=1e-5, abs=1e-6)
    per_slot = loss.per_slot(logits, probs).reshape(-1)
    assert per_slot.tolist() == pytest.approx(slot_values(name, logits, read, 2.0), rel=1e-5)
    # The controls: the targets of the next slot, and (asymmetric losses) p and q swapped.
    controls = [slot_values(name, logits, read.roll(1, dims=1), 2.0)]
    if name in ASYMMETRIC:
        controls.append(slot_values(name, read.clamp_min(1e-30).log(), logits.softmax(-1), 2.0))
    for control in controls:
        assert (torch.tensor(control) - per_slot).abs().max() > 1e-2


@pytest.mark.parametrize("name", NAMES)
def test_each_loss_is_speculators_own(name):
    """speculators takes target logits: log p gives back p. Its `kl_div_loss` is KL(p || q),
    ours the soft cross-entropy KL + H(p); its LK-hybrid takes eta as ours."""
    eager = speculators_module("losses.eager")
    logits, probs, _, _ = supervision(seed=1)
    probs = probs.clamp_min(1e-30) / probs.clamp_min(1e-30).sum(-1, keepdim=True)
    flat_logits, flat_probs = logits.reshape(1, -1, logits.shape[-1]), probs.reshape(1, -1, 9)
    kwargs = {"eta": 1.5} if name == "lk_hybrid" else {}
    theirs = getattr(eager, SPECULATORS[name])(flat_logits, flat_probs.log(), **kwargs)[0]
    if name == "forward_kl":
        theirs = theirs - (flat_probs * flat_probs.log()).sum(-1)[0]
    ours = SlotLoss(name, lk_eta=1.5).per_slot(logits, probs).reshape(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    control = getattr(eager, SPECULATORS[name])(flat_logits, flat_probs.roll(1, 1).log(),
                                                **kwargs)[0]
    assert (control - ours).abs().max() > 1e-2


def test_the_default_is_todays_soft_cross_entropy_bit_for_bit():
    logits, probs, position_mask, loss_mask = supervision(seed=2)
    # Today's soft_cross_entropy, as it was written before train.loss existed.
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    per_slot = -(probs * log_probs).sum(dim=-1)
    weight = (loss_mask.bool() & position_mask.bool()).float()
    today = (per_slot * weight).sum() / weight.sum().clamp_min(1.0)
    assert torch.equal(SlotLoss().mean(logits, probs, position_mask, loss_mask), today)
    assert torch.equal(soft_cross_entropy(logits, probs, position_mask, loss_mask), today)
    assert not torch.equal(SlotLoss("reverse_kl").mean(logits, probs, position_mask, loss_mask),
                           today)


@pytest.mark.parametrize("name", NAMES)
def test_each_loss_trains_the_draft_towards_the_target(name):
    """Adam on free logits: every loss brings the draft's distribution to the target's (the
    rejection probability, TV, falls to a fraction of where it began)."""
    logits, probs, _, _ = supervision(seed=3)
    logits = logits.clone().requires_grad_(True)
    ones = torch.ones(logits.shape[:-1], dtype=torch.bool)
    loss = SlotLoss(name)
    tv_before = float(SlotLoss("total_variation").mean(logits.detach(), probs, ones, ones))
    optimizer = torch.optim.Adam([logits], lr=0.1)
    values = []
    for _ in range(60):
        value = loss.mean(logits, probs, ones, ones)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        values.append(float(value.detach()))
    tv_after = float(SlotLoss("total_variation").mean(logits.detach(), probs, ones, ones))
    assert values[-1] < values[0] and tv_after < 0.5 * tv_before, (values[0], values[-1])


def test_d_pace_weights_are_eq_8_and_speculators():
    generator = torch.Generator().manual_seed(4)
    confidence = torch.rand(3, 5, 6, generator=generator)
    valid = torch.rand(3, 5, 6, generator=generator) > 0.25
    weights = dpace_weights(confidence, valid, alpha=0.3)
    for block in range(15):
        c, v = confidence.view(15, 6)[block].tolist(), valid.view(15, 6)[block].tolist()
        assert weights.view(15, 6)[block].tolist() == pytest.approx(
            dpace_block_weights(c, v, 0.3), rel=1e-6, abs=1e-7)
    # speculators' blocks begin with the anchor's slot, which it never supervises; its
    # confidence comes from the cross-entropy it is given (masked).
    utils = speculators_module("losses.utils")
    mask = torch.cat([torch.zeros(15, 1, dtype=torch.bool), valid.view(15, 6)], dim=1)
    elementwise = -torch.cat([torch.ones(15, 1), confidence.view(15, 6)], dim=1).log() * mask
    theirs = utils.dpace_loss_decay(None, loss_mask=mask.view(1, -1), block_size=7,
                                    dpace_alpha=0.3, elementwise_loss=elementwise.view(1, -1))
    torch.testing.assert_close(weights.view(15, 6), theirs.view(15, 7)[:, 1:])
    other = dpace_weights(confidence, valid, alpha=0.9)  # the control: another smoothing
    assert (other - weights).abs().max() > 1e-2


def test_d_pace_confidence_is_the_draft_probability_of_the_targets_top_token():
    logits, probs, _, _ = supervision(seed=5)
    confidence = top_token_confidence(logits, probs)
    expected = torch.softmax(logits, -1).gather(-1, probs.argmax(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(confidence, expected)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 9), probs.argmax(-1).view(-1),
                                           reduction="none")
    torch.testing.assert_close(confidence.view(-1), (-ce).exp())  # exp(-CE), as D-PACE reads it


def test_masked_mean_counts_only_supervised_slots():
    per_slot = torch.tensor([[1.0, 2.0, 4.0]])
    assert float(masked_mean(per_slot, torch.tensor([[1, 1, 0]]), torch.tensor([[0, 1, 1]]))) == 2
    assert float(masked_mean(per_slot, torch.zeros(1, 3), torch.ones(1, 3))) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "rkl"}, "unknown loss 'rkl'; choose one of forward_kl"),
    ({"name": "lk_hybrid", "lk_eta": -1.0}, "lk_eta must be")])
def test_a_wrong_loss_is_refused_naming_the_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlotLoss(**kwargs)
