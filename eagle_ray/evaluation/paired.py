"""The exact expectation of vLLM's sampled acceptance on vLLM's own answers: a paired comparison.

vLLM 0.32 drafts greedily (`draft_sample_method: greedy`, the default) and verifies with its
standard rejection sampler: draft token j is accepted with probability p(d_j) under the target's
temperature-scaled distribution, and a rejection emits a token drawn from p without d_j. So an
emitted token equals the drafted one exactly when it was accepted, and an answer fixes its own
verify steps: the first starts after the answer's first token, each drafts the draft's chain
there and accepted the drafted tokens the answer goes on with, and the next starts at the token
after them. Replaying vLLM's answers with the project's draft on the target's states gives, for
every verify step vLLM ran, its draft tokens and their alphas, hence E[accepted | context] and
Var[accepted | context] (`VerifyStep.moments`, over all k draft tokens: vLLM counts a token
accepted past a stop token too). vLLM's accepted count minus their sum is a martingale: within
a few sqrt(sum Var) of 0 when vLLM samples as speculative sampling says. Both figures are on the
same answers, so which answers happened to be sampled -- the spread a comparison with the
simulation's own answers carries, and which its range leaves out -- cancels.

On the CPU build in fp32 the replay drafts what vLLM drafted at every step, so each answer's
replayed verify steps are as many as vLLM's counters hold (`answers_with_vllms_steps`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.draft.model import Eagle3Draft
from eagle_ray.evaluation.acceptance import AcceptanceTally, ServedAnswer
from eagle_ray.evaluation.simulate import (
    SampledAcceptance,
    VerifyStep,
    draft_chain,
    target_states,
)

Z_95 = 1.96


@dataclasses.dataclass
class PairedAcceptance:
    """vLLM's counters for a set of its answers (`served`) beside the exact moments of every
    verify step replayed on the same answers (`replayed`: its tally holds the counts the answers
    show, which at an answer's last step may stop short of vLLM's, as the answer does)."""

    served: AcceptanceTally
    replayed: SampledAcceptance
    answers: int = 0
    answers_with_vllms_steps: int = 0

    def standard_error(self) -> float:
        """The spread of vLLM's length given its answers: sqrt(sum Var) / verify steps."""
        steps = self.replayed.tally.steps
        return math.sqrt(sum(self.replayed.variance)) / steps if steps else float("nan")

    def summary(self) -> dict[str, Any]:
        """The figures a summary keeps (`eagle_ray.train.report.vllm_agrees` reads them)."""
        exact, error = self.replayed.expected_length(), self.standard_error()
        return {"expected": exact, "standard_error": error,
                "interval_95": [exact - Z_95 * error, exact + Z_95 * error],
                "verify_steps": self.replayed.tally.steps,
                "vllm_verify_steps": self.served.steps, "vllm_length": self.served.length(),
                "answers": self.answers, "answers_with_vllms_steps": self.answers_with_vllms_steps,
                "acceptance_per_position": self.replayed.expected_per_position()}


def leading_matches(drafted: Sequence[int], emitted: Sequence[int]) -> int:
    """Draft tokens accepted: those the answer goes on with, in order."""
    accepted = 0
    while accepted < min(len(drafted), len(emitted)) and drafted[accepted] == emitted[accepted]:
        accepted += 1
    return accepted


@torch.inference_mode()
def replay_served(target: RunnerEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                  answers: Sequence[ServedAnswer], k: int, temperature: float
                  ) -> PairedAcceptance:
    """Every verify step of vLLM's `answers` (sampled at `temperature` > 0, `k` draft tokens a
    step) replayed with `draft` on `target`'s states: the exact moments on vLLM's own answers."""
    head = target.get_target_head()
    result = PairedAcceptance(AcceptanceTally.empty(k),
                              SampledAcceptance(AcceptanceTally.empty(k), reach=[0.0] * k))

    def distribution(hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(head(hidden).float() / temperature, dim=-1).cpu()

    for served in answers:
        if served.histogram is not None:
            result.served.add(served.histogram)
        steps = _replay_answer(target, distribution, draft, vocab, served, k, result.replayed)
        result.answers += 1
        result.answers_with_vllms_steps += steps == sum(served.histogram or [])
    return result


def _replay_answer(target: RunnerEagle3TargetModel, distribution, draft: Eagle3Draft,
                   vocab: DraftVocab, served: ServedAnswer, k: int, into: SampledAcceptance
                   ) -> int:
    """One answer's verify steps recorded `into` the replay (the target run twice: on the whole
    answer for the draft's aux states, each step's context a causal prefix of it, then on every
    step's verified tokens in one batch); returns how many steps."""
    ids = served.prompt + served.answer
    aux, _ = target_states(target, ids)
    steps: list[tuple[int, list[int], int]] = []  # (context length, next token + drafts, accepted)
    start = len(served.prompt)
    while start < len(ids) - 1:  # a token after `ids[start]`: a verify step emitted it
        drafted = draft_chain(draft, vocab, aux[:, :start], ids[:start], ids[start], k)
        accepted = leading_matches(drafted, ids[start + 1:])
        steps.append((start, [ids[start], *drafted], accepted))
        start += accepted + 1
    verified = final_states(target, [ids[:start] + tail for start, tail, _ in steps])
    for (start, tail, accepted), last_hidden in zip(steps, verified, strict=True):
        probs = distribution(last_hidden[start:])  # after the next token and each draft token
        alphas = [float(probs[j, token]) for j, token in enumerate(tail[1:])]
        into.record(VerifyStep(tail[1:], probs, alphas, stopped=False), accepted)
    return len(steps)


def final_states(target: RunnerEagle3TargetModel, sequences: list[list[int]]
                 ) -> list[torch.Tensor]:
    """The target's final pre-norm states `[len, H]` of each sequence, in one right-padded call
    (copied out of a vLLM runner's hand-off, whose ring the next call reuses)."""
    if not sequences:
        return []
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
    out = target.runner.run(ids, mask)
    if out.rows is None:
        return [out.last_hidden[row, :len(s)] for row, s in enumerate(sequences)]
    return [row[:, -1].to(target.device, copy=True) for row in out.rows]
