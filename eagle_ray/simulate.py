"""The project's own acceptance measurement: chain drafting simulated with the HF target and the
draft, independent of vLLM's speculative decoding, greedy and sampled.

Per verify step the target has its next token, the draft proposes `k` more from the target's aux
states (greedily, as vLLM's EAGLE proposer does), and the target verifies them. Greedy: a draft
token is accepted while it equals the target's greedy continuation. Sampled (speculative
sampling with a deterministic draft): draft token `x` is accepted with probability `p(x)` under
the target's temperature-scaled distribution; on a rejection the next token is drawn from `p`
without `x`, after `k` acceptances from the next position's `p`. Acceptance length is vLLM's
definition, 1 + accepted / verify steps, so the two measurements compare.
"""

from __future__ import annotations

import torch

from eagle_ray.acceptance import AcceptanceTally
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.draft.model import Eagle3Draft, shift_left
from eagle_ray.supervision import DraftVocab


def draft_chain(draft: Eagle3Draft, vocab: DraftVocab, aux_hidden_states: torch.Tensor,
                seq: list[int], next_token: int, k: int) -> list[int]:
    """`k` tokens the draft proposes after `seq` + `next_token`, greedily (target ids); step j
    reads, at the last slot, the token drafted by step j - 1."""
    step_ids = [torch.tensor([seq[1:] + [next_token]], device=aux_hidden_states.device)]
    drafted: list[int] = []
    for _ in range(k):
        logits = draft(aux_hidden_states.float(), step_ids)[-1][0, -1]
        drafted.append(int(vocab.draft_to_target[int(logits.argmax())]))
        step = shift_left(step_ids[-1], 1)
        step[0, -1] = drafted[-1]
        step_ids.append(step)
    return drafted


@torch.inference_mode()
def simulate_acceptance(target: HFEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                        prompts: list[list[int]], continuations: list[list[int]], k: int
                        ) -> tuple[float, list[float]]:
    """Greedy: mean acceptance length over each prompt's greedy continuation (up to its
    end-of-turn token, as vLLM stops there), and the share accepted per draft position."""
    head = target.get_target_head()
    tally = AcceptanceTally.empty(k)
    for prompt, continuation in zip(prompts, continuations, strict=True):
        seq, produced = list(prompt), 0
        while produced < len(continuation):
            ids = torch.tensor([seq])
            out = target.runner.run(ids, torch.ones_like(ids))
            next_token = int(head(out.last_hidden[0, -1]).argmax())
            truth = continuation[produced + 1: produced + 1 + k]
            if not truth:  # the answer ends with this token: no draft left to verify
                break
            drafted = draft_chain(draft, vocab, out.aux_hidden_states, seq, next_token, k)
            accepted = 0
            while accepted < len(truth) and drafted[accepted] == truth[accepted]:
                accepted += 1
            seq += [next_token] + drafted[:accepted]
            produced += 1 + accepted
            tally.record(accepted)
    return tally.length(), tally.per_position()


@torch.inference_mode()
def simulate_sampled_acceptance(target: HFEagle3TargetModel, draft: Eagle3Draft,
                                vocab: DraftVocab, prompts: list[list[int]], k: int,
                                temperature: float, max_new_tokens: int,
                                stop_token_ids: tuple[int, ...], seed: int = 0
                                ) -> tuple[float, list[float]]:
    """Sampled at `temperature` (> 0): speculative sampling of the target's own answers, each
    up to `max_new_tokens` or a stop token (see the module doc)."""
    head = target.get_target_head()
    generator = torch.Generator().manual_seed(seed)
    stops = set(stop_token_ids)
    tally = AcceptanceTally.empty(k)

    def distribution(hidden: torch.Tensor) -> torch.Tensor:  # on the host: sampled there
        return torch.softmax(head(hidden).float() / temperature, dim=-1).cpu()

    def sample(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=generator))

    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.runner.run(ids, torch.ones_like(ids))
        seq, next_token, produced = list(prompt), sample(distribution(out.last_hidden[0, -1])), 0
        aux = out.aux_hidden_states  # of every token of seq (causal: a longer run's prefix)
        while next_token not in stops and produced + 1 < max_new_tokens:
            drafted = draft_chain(draft, vocab, aux, seq, next_token, k)
            ids = torch.tensor([seq + [next_token] + drafted])
            out = target.runner.run(ids, torch.ones_like(ids))
            # probs[j]: the target's distribution for the token after next_token + drafted[:j].
            probs = distribution(out.last_hidden[0, len(seq):])
            accepted, following = 0, None
            for j, token in enumerate(drafted):
                if float(torch.rand((), generator=generator)) >= float(probs[j, token]):
                    rest = probs[j].clone()
                    rest[token] = 0
                    following = sample(rest / rest.sum())
                    break
                accepted += 1
                if token in stops:
                    break
            kept = [next_token] + drafted[:accepted]
            tally.record(accepted)
            seq += kept
            produced += len(kept)
            aux = out.aux_hidden_states[:, :len(seq)]
            if stops & set(kept):
                break
            next_token = following if following is not None else sample(probs[k])
    return tally.length(), tally.per_position()
