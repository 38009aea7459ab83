"""The self-check: the engine's supervision is checked against what the target must produce,
on every micro-batch, so a capture that silently went wrong stops the job with its likely cause
(docs/contract.md, "The self-check"). `base` re-exports these names."""

from __future__ import annotations

import torch

from eagle_ray.contract.target_head import TargetHead
from eagle_ray.devices import hand_over

# The self-check's rule, per row: the engine's greedy token is accepted when the head's logit for
# it is within SELF_CHECK_EPS x eps(head dtype) x max(|best logit|, 1) of the head's best logit.
# Why: the engine and the head each round a logit to the head's dtype (half an ulp each; an ulp
# is at most eps x |logit|), so a near-tie may flip by up to 2 eps x |best|; 4 doubles that for
# what differs before (the engine norms its unrounded final sum, the head the captured bf16 one).
# Measured on vLLM in bf16 (`eagle-ray bench self-check`, docs/contract.md): the right capture
# fell at most 1.5 eps x |best| short and no row of 2,048 was refused; a capture one layer off
# was caught on 89 % (tiny target) and 97 % (Llama-3.1-8B shapes) of the rows where its argmax
# differs at all. 64 (half the best logit) let it through on the tiny pre-trained Llama
# (tests/backends/test_self_check.py).
SELF_CHECK_EPS = 4
SELF_CHECK_RULE = (f"logit(engine token) >= best - {SELF_CHECK_EPS} eps(head dtype) "
                   f"max(abs(best), 1)")


class SelfCheckError(RuntimeError):
    """The engine's greedy token disagrees with the head applied to the captured final state."""


def greedy_shortfall(next_token_ids: torch.Tensor, logits: torch.Tensor,
                     head_dtype: torch.dtype) -> torch.Tensor:
    """`[B]`: how far each row's engine token falls short of the head's best logit, in units of
    the self-check's tolerance (`SELF_CHECK_RULE`): 0 where it is the argmax (or ties it), above
    1 where the check refuses it. `logits [B, V]` (float) are the head's over the captured final
    states; `next_token_ids [B]` on the same device."""
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, next_token_ids.view(-1, 1)).squeeze(1)
    eps = max(1e-4, SELF_CHECK_EPS * torch.finfo(head_dtype).eps)
    return (best - chosen) / (eps * best.abs().clamp_min(1.0))


def refused_rows(next_token_ids: torch.Tensor, logits: torch.Tensor,
                 head_dtype: torch.dtype) -> torch.Tensor:
    """`[B]` bool: the rows whose engine token the self-check refuses (a pure function of the
    head's logits; `check_greedy_tokens` and `eagle-ray bench self-check` both decide by it)."""
    return greedy_shortfall(next_token_ids, logits, head_dtype) > 1


def check_greedy_tokens(next_token_ids: torch.Tensor, final_states: torch.Tensor,
                        head: TargetHead) -> None:
    """Each row's engine-sampled greedy token must be the argmax of `head(final_states[row])`
    (`final_states [B, H]`: the captured final pre-norm state at each row's last position).

    This catches the silent failures of capture: a layer-id convention off by one, a final norm
    applied twice or not at all, a head in the wrong dtype. Near-ties (within the precision of
    the head's dtype) are accepted (`refused_rows`).
    """
    head_device = head.lm_head.weight.device
    states, next_token_ids = hand_over((final_states, next_token_ids), head_device)
    logits = head(states).float()  # [B, V]
    refused = refused_rows(next_token_ids, logits, head.lm_head.weight.dtype)
    bad = torch.nonzero(refused.cpu()).flatten().tolist()  # the one read
    if bad:
        row = bad[0]
        chosen, best = logits[row, int(next_token_ids[row])], logits[row].max()
        raise SelfCheckError(
            f"self-check failed on {len(bad)} of {len(logits)} rows: the engine's greedy token "
            f"{int(next_token_ids[row])} (logit {float(chosen):.4f}) is not the argmax "
            f"{int(logits[row].argmax())} (logit {float(best):.4f}) of the target head "
            f"applied to the captured final hidden state (row {row}). Likely causes: capture "
            "ids in the wrong layer-id convention (vLLM's are pre-layer: canonical k -> k + 1, "
            "final state -> N), the final norm applied twice or not at all, or a dtype "
            "mismatch between the engine and the head. Pass self_check=False only to debug."
        )


# The rank check's tolerance: TP ranks hold the same residual stream, so their captured rows are
# equal in exact arithmetic; an all-reduce may sum the ranks' parts in another order on each
# rank, which moves a bf16 value by a few of its ulps (2**-8 each), far below what a rank's
# partial sum misses (at TP 2, about half of every layer's contribution).
RANK_CHECK_RTOL = 2**-5


def check_ranks_agree(rank_zero_rows: torch.Tensor, rank_rows: torch.Tensor, rank: int,
                      capture_id: int) -> None:
    """TP rank `rank`'s copy of a captured layer (`[requests, H]`, one row each) must equal rank
    0's, the one the supervision comes from, within `RANK_CHECK_RTOL` of the row's largest
    value. This covers an aux layer, which the greedy-token check (the final state) does not:
    a capture that read one rank's partial sum -- what a compilation pass that rewrites the
    all-reduce around the captured nodes could make of it -- differs between the ranks."""
    expected, got = rank_zero_rows.float(), rank_rows.float()
    scale = expected.abs().amax(dim=-1).clamp_min(1e-6)
    error = (got - expected).abs().amax(dim=-1) / scale
    bad = torch.nonzero(error > RANK_CHECK_RTOL).flatten().tolist()
    if bad:
        raise SelfCheckError(
            f"rank check failed on {len(bad)} of {len(error)} requests: TP rank {rank}'s "
            f"captured states of vLLM layer id {capture_id} differ from rank 0's by "
            f"{float(error[bad[0]]):.3f} of their scale (request {bad[0]}), though every rank "
            "holds the same residual stream. The capture read a rank's partial sum: a "
            "compilation pass that rewrites the all-reduce (compilation_config.pass_config, "
            "e.g. fuse_allreduce_rms) or a custom all-reduce is the likely cause; turn it off. "
            "Pass self_check=False only to debug.")
