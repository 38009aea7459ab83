"""The draft's training objectives (`train.loss`): one per-slot divergence between the draft's
distribution q (softmax of its draft-vocabulary logits) and the target's p (renormalised over
the draft vocabulary, `supervision.draft_target`), and the masked mean every kind reduces them
with; and D-PACE's position weights for DFlash's block loss (`draft.loss_weighting: dpace`).

Each function takes draft logits `[..., V_draft]` (any dtype: computed in fp32) and target
probabilities `[..., V_draft]` and returns one value per slot `[...]`. The acceptance rate of
speculative sampling at a slot is alpha = sum_v min(p_v, q_v) = 1 - TV(p, q) (Leviathan et al.
2023), which total variation, negative log-acceptance and LK-hybrid optimise directly; the
divergences are DistillSpec's (Zhou et al. 2023, arXiv 2310.08461). vLLM's speculators 0.9
(`speculators/losses/eager.py`) defines each too; the tests use it as a second oracle.
"""

from __future__ import annotations

import dataclasses
import math

import torch

LK_ETA = 3.0  # LK-hybrid's blend temperature: the paper's best hybrid setting (speculators')
NLA_EPS = 1e-5  # negative log-acceptance floors alpha here (speculators' `_NLA_EPS`)
DPACE_ALPHA = 0.5  # D-PACE's confidence smoothing: the paper's default (speculators')
# log p where the target's fp32 probability underflowed to 0 (reverse KL reads log p).
_LOG_FLOOR = torch.finfo(torch.float32).tiny


def forward_kl(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy -sum_v p log q = KL(p || q) + H(p): forward KL plus the target's
    entropy, which no draft weight changes (the same gradient), so the logged value is the
    cross-entropy every draft here trained with before the choice existed (EAGLE-3's
    objective; speculators `kl_div_loss` is KL(p || q) alone)."""
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
    return -(target_probs * log_probs).sum(dim=-1)


def reverse_kl(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """KL(q || p) = sum_v q (log q - log p): mode seeking (DistillSpec's RKL; speculators
    `reverse_kl_div_loss`). A target probability that underflowed to 0 reads as the smallest
    fp32 normal, so the loss stays finite where the target puts (almost) no mass."""
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    log_p = target_probs.clamp_min(_LOG_FLOOR).log()
    return (log_q.exp() * (log_q - log_p)).sum(dim=-1)


def jensen_shannon(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """JSD = KL(p || m) / 2 + KL(q || m) / 2 with m = (p + q) / 2: symmetric, bounded by
    log 2 (Lin 1991; DistillSpec's JSD; speculators `js_div_loss`)."""
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    q = log_q.exp()
    log_m = torch.log((target_probs + q) / 2)  # m > 0: q is a softmax
    kl_p = (torch.xlogy(target_probs, target_probs) - target_probs * log_m).sum(dim=-1)
    kl_q = (q * (log_q - log_m)).sum(dim=-1)
    return 0.5 * (kl_p + kl_q)


def acceptance(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p_v, q_v): the probability that speculative sampling accepts the
    draft's token at the slot."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    return torch.minimum(q, target_probs).sum(dim=-1)


def total_variation(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1 - alpha: the rejection probability itself (DistillSpec's TVD; speculators
    `tv_loss`)."""
    return 1.0 - acceptance(draft_logits, target_probs)


def neg_log_acceptance(draft_logits: torch.Tensor, target_probs: torch.Tensor
                       ) -> torch.Tensor:
    """-log max(alpha, 1e-5): TV's acceptance-optimal target with its gradient scaled by
    1 / alpha, usable from a cold start (Samarin et al., "LK Losses", arXiv 2602.23881;
    speculators `neg_log_acceptance_loss`); cross-entropy when the target is one token."""
    return -torch.log(acceptance(draft_logits, target_probs).clamp_min(NLA_EPS))


def lk_hybrid(draft_logits: torch.Tensor, target_probs: torch.Tensor, eta: float = LK_ETA
              ) -> torch.Tensor:
    """lambda KL(p || q) + (1 - lambda) TV(p, q), lambda = exp(-eta sg[alpha]): KL's strong
    gradient while the draft and target overlap little, TV's acceptance objective as they
    come to (Samarin et al., "LK Losses", arXiv 2602.23881, the hybrid objective; speculators
    `lk_hybrid_loss`). KL here is KL itself (soft cross-entropy minus H(p)), as the paper's."""
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    kl = (torch.xlogy(target_probs, target_probs) - target_probs * log_q).sum(dim=-1)
    alpha = torch.minimum(log_q.exp(), target_probs).sum(dim=-1)
    weight = torch.exp(-eta * alpha.detach())
    return weight * kl + (1.0 - weight) * (1.0 - alpha)


LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jensen_shannon": jensen_shannon,
          "total_variation": total_variation, "lk_hybrid": lk_hybrid,
          "neg_log_acceptance": neg_log_acceptance}


def masked_mean(per_slot: torch.Tensor, position_mask: torch.Tensor, loss_mask: torch.Tensor
                ) -> torch.Tensor:
    """Mean of `per_slot` over slots where both `loss_mask` and `position_mask` hold (0 where
    none does)."""
    weight = (loss_mask.bool() & position_mask.bool()).float()
    return (per_slot * weight).sum() / weight.sum().clamp_min(1.0)


@dataclasses.dataclass(frozen=True)
class SlotLoss:
    """`train.loss` with its parameter: what every draft kind scores a slot with."""

    name: str = "forward_kl"
    lk_eta: float = LK_ETA  # lk_hybrid's only

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"unknown loss {self.name!r}; choose one of {', '.join(LOSSES)}")
        if not (math.isfinite(self.lk_eta) and self.lk_eta >= 0):
            raise ValueError(f"lk_eta must be a finite number >= 0, got {self.lk_eta}")

    def per_slot(self, draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
        if self.name == "lk_hybrid":
            return lk_hybrid(draft_logits, target_probs, self.lk_eta)
        return LOSSES[self.name](draft_logits, target_probs)

    def mean(self, draft_logits: torch.Tensor, target_probs: torch.Tensor,
             position_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The masked mean of `per_slot` (what one TTT step or block slot contributes)."""
        return masked_mean(self.per_slot(draft_logits, target_probs), position_mask, loss_mask)


FORWARD_KL = SlotLoss()  # the default: today's soft cross-entropy


@torch.no_grad()
def top_token_confidence(draft_logits: torch.Tensor, target_probs: torch.Tensor
                         ) -> torch.Tensor:
    """exp(-CE) of the draft against the target's most likely token: the draft's probability
    of that token (D-PACE's per-position confidence)."""
    logits = draft_logits.float()
    top = target_probs.argmax(dim=-1, keepdim=True)
    return (logits.gather(-1, top) - logits.logsumexp(dim=-1, keepdim=True)).squeeze(-1).exp()


@torch.no_grad()
def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float = DPACE_ALPHA
                  ) -> torch.Tensor:
    """D-PACE's weights `[..., L]` of a block's L predicted slots (arXiv 2605.18810, Eq. 7-8;
    speculators `losses/utils.py` `dpace_loss_decay`): with smoothed confidences
    c_i = (1 - alpha) q_i + alpha (1 at slots not supervised), slot j's weight is
    sum_{m >= j} prod_{i <= m} c_i over supervised m -- the derivative of the block's expected
    accepted length by log q_j -- and 0 where it is not supervised. Detached: the weights
    shape the gradient, none flows through them."""
    valid = valid.to(confidence.dtype)
    smooth = torch.where(valid > 0, (1.0 - alpha) * confidence + alpha, 1.0)
    prefix = smooth.cumprod(dim=-1)
    return (prefix * valid).flip(-1).cumsum(-1).flip(-1) * valid
