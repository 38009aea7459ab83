"""`train.loss` through every kind's objective: the TTT loss (EAGLE-3, P-EAGLE) with each loss
equals the 0.8^k-weighted sum of slot-by-slot computations on the draft's own logits; the
default equals today's soft cross-entropy bit for bit (TTT and DFlash's block loss); the learner
trains with the configured loss. DFlash with each loss and D-PACE: tests/draft/test_dflash.py."""

import math

import pytest
import torch

from eagle_ray.contract.losses import LOSSES, SlotLoss
from eagle_ray.contract.supervision import draft_target
from eagle_ray.draft.dflash import DFlashDraft, default_decay_gamma, sample_anchors
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.peagle import PEagleDraft

from learner_helpers import tiny_batch, tiny_learner
from loss_oracles import masked_mean_of_slots

HIDDEN, VOCAB, ROWS, SEQ, DEPTH = 32, 48, 2, 9, 3
CONFIG = DraftConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=HIDDEN // 2, intermediate_size=64,
                     vocab_size=VOCAB, draft_vocab_size=VOCAB)


def supervision(seed: int = 0):
    """(aux states, ids, loss mask, target probabilities, position mask) at random."""
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(ROWS, SEQ, 3 * HIDDEN, generator=generator)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    loss_mask = (torch.rand(ROWS, SEQ, generator=generator) > 0.3).long()
    probs = torch.softmax(3 * torch.randn(ROWS, SEQ, VOCAB, generator=generator), dim=-1)
    position_mask = torch.rand(ROWS, SEQ, generator=generator) > 0.2
    return aux, ids, loss_mask, probs, position_mask


def chain_draft(kind: str) -> Eagle3Draft:
    torch.manual_seed(0)
    return Eagle3Draft(CONFIG) if kind == "eagle3" else PEagleDraft(CONFIG, mask_token_id=0)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("name", list(LOSSES))
@torch.no_grad()
def test_the_ttt_loss_is_each_steps_loss_computed_slot_by_slot(kind, name):
    draft = chain_draft(kind)
    aux, ids, loss_mask, probs, position_mask = supervision()
    loss, per_step, _ = draft.objective(draft, aux, ids, loss_mask, probs, position_mask, DEPTH,
                                        loss=SlotLoss(name))
    logits = draft(aux, draft.step_inputs(ids, DEPTH))
    expected, steps = 0.0, []
    for k in range(DEPTH):  # step k at slot t against the target at t + k
        mask = (loss_mask[:, k:].bool() & position_mask[:, k:])
        steps.append(masked_mean_of_slots(name, logits[k][:, :SEQ - k], probs[:, k:], mask))
        expected += 0.8**k * steps[-1]
    assert per_step.tolist() == pytest.approx(steps, rel=1e-5, abs=1e-6)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # The control: another loss on the same logits.
    other = "reverse_kl" if name == "forward_kl" else "forward_kl"
    assert abs(float(draft.objective(draft, aux, ids, loss_mask, probs, position_mask, DEPTH,
                                     loss=SlotLoss(other))[0]) - expected) > 1e-2


def todays_soft_cross_entropy(logits, probs, position_mask, loss_mask):
    """soft_cross_entropy as it was written before train.loss existed."""
    per_slot = -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(dim=-1)
    weight = (loss_mask.bool() & position_mask.bool()).float()
    return (per_slot * weight).sum() / weight.sum().clamp_min(1.0)


def todays_block_loss(draft, aux, ids, loss_mask, probs, position_mask, depth):
    """DFlash's objective as it was written before train.loss and D-PACE existed."""
    anchors, kept = sample_anchors(loss_mask, position_mask, draft.anchors_per_row)
    block = torch.full((*anchors.shape, depth + 1), draft.mask_token_id, dtype=ids.dtype)
    block[..., 0] = ids.gather(1, anchors)
    logits = draft(aux, anchors, block)
    seq, vocab = ids.shape[1], probs.shape[-1]
    gamma = default_decay_gamma(depth + 1)
    weighted = counted = torch.zeros(())
    for j in range(1, depth + 1):
        source, label = anchors + j - 1, anchors + j
        valid = (kept & (label < seq) & loss_mask.bool().gather(1, label.clamp(max=seq - 1))
                 & position_mask.gather(1, source.clamp(max=seq - 1)))
        slot_probs = probs.gather(1, source.clamp(max=seq - 1).unsqueeze(-1)
                                  .expand(-1, -1, vocab))
        loss = todays_soft_cross_entropy(logits[:, :, j], slot_probs, valid, valid)
        slots = valid.sum()
        weighted = weighted + math.exp(-(j - 1) / gamma) * loss * slots
        counted = counted + math.exp(-(j - 1) / gamma) * slots
    return weighted / counted.clamp_min(1e-6)


@torch.no_grad()
def test_the_default_objectives_are_todays_bit_for_bit():
    aux, ids, loss_mask, probs, position_mask = supervision(seed=1)
    for kind in ("eagle3", "peagle"):
        draft = chain_draft(kind)
        loss = draft.objective(draft, aux, ids, loss_mask, probs, position_mask, DEPTH)[0]
        logits = draft(aux, draft.step_inputs(ids, DEPTH))
        today = torch.zeros(())
        for k in range(DEPTH):
            today = today + 0.8**k * todays_soft_cross_entropy(
                logits[k].narrow(1, 0, SEQ - k), probs.narrow(1, k, SEQ - k),
                position_mask.narrow(1, k, SEQ - k), loss_mask.narrow(1, k, SEQ - k))
        assert torch.equal(loss, today), kind
    torch.manual_seed(0)
    draft = DFlashDraft(CONFIG, mask_token_id=0, anchors_per_row=4)
    torch.manual_seed(5)  # the same anchors for both
    loss = draft.objective(draft, aux, ids, loss_mask, probs, position_mask, DEPTH)[0]
    torch.manual_seed(5)
    today = todays_block_loss(draft, aux, ids, loss_mask, probs, position_mask, DEPTH)
    assert torch.equal(loss, today)
    torch.manual_seed(5)  # the control: another loss on the same blocks
    other = draft.objective(draft, aux, ids, loss_mask, probs, position_mask, DEPTH,
                            loss=SlotLoss("jensen_shannon"))[0]
    assert abs(float(other - today)) > 1e-2


def test_the_learner_trains_with_the_configured_loss():
    """Its step's loss is the objective's under `train.loss` (and not the default's), its
    default the soft cross-entropy; a few steps lower it."""
    for name in ("forward_kl", "total_variation"):
        learner = tiny_learner(loss=name, lr=1e-2)
        batch = tiny_batch(0)
        probs, position_mask = draft_target(batch, learner.vocab, learner.head)
        with torch.no_grad():
            expected, default = (learner.draft.objective(
                learner.model, batch.aux_hidden_states, batch.input_ids, batch.loss_mask, probs,
                position_mask, learner.train.ttt_steps, None, SlotLoss(n))[0]
                for n in (name, "forward_kl"))
        first = learner.step(batch)["loss"]
        assert torch.equal(first, expected)
        assert torch.equal(first, default) == (name == "forward_kl")
        for _ in range(5):
            last = learner.step(batch)["loss"]
        assert float(last) < float(first)
