"""The exact expectation on vLLM's own sampled answers (`eagle_ray.evaluation.paired`) and the
agreement check that reads it (`eagle_ray.train.report.vllm_agrees`). Answers sampled by the
project's own speculative sampler stand in for vLLM's here (vLLM samples by the same rule; its
real answers are replayed in tests/train/test_train.py). No stop token: each answer runs to
MAX_NEW_TOKENS, so the sampler's chains and the replay's are the same k tokens."""

import pytest
import torch

from eagle_ray.evaluation import simulate
from eagle_ray.evaluation.acceptance import ServedAnswer
from eagle_ray.evaluation.paired import leading_matches, replay_served
from eagle_ray.evaluation.simulate import simulate_sampled
from eagle_ray.train.report import AGREEMENT_Z, paired_deviation, vllm_agrees

K = 3
MAX_NEW_TOKENS = 24
TEMPERATURE = 2.0  # the tiny target is sure of itself at 1: spread to tell figures apart with


def _sampled(tiny_pair, prompts: int = 16) -> tuple[list[ServedAnswer], list]:
    """Each prompt answered by the simulation's sampler (seeded by its index), with its own
    counts as the answer's counters; and each answer's `SampledAcceptance`."""
    target, draft, vocab, all_prompts, _ = tiny_pair
    runs = [simulate_sampled(target, draft, vocab, [prompt], K, TEMPERATURE, MAX_NEW_TOKENS,
                             (), seed) for seed, prompt in enumerate(all_prompts[:prompts])]
    served = [ServedAnswer(prompt, run.answers[0], list(run.tally.histogram))
              for prompt, run in zip(all_prompts, runs, strict=False)]
    return served, runs


@pytest.fixture(scope="module")
def sampled(tiny_pair):
    """The sampled answers, their runs, and the answers replayed with the sampler's draft."""
    target, draft, vocab, _, _ = tiny_pair
    served, runs = _sampled(tiny_pair)
    return served, runs, replay_served(target, draft, vocab, served, K, TEMPERATURE)


def _rows(paired) -> tuple[dict, dict]:
    """A vLLM row and a simulated row as the summary holds them."""
    measured = {"mean_acceptance_length": paired.served.length(), "interval_95": [1.0, 4.0]}
    simulated = {"trained": paired.served.length(), "trained_expected": 0.0,
                 "trained_expected_interval_95": [0.0, 0.0],
                 "trained_on_vllm_answers": paired.summary()}
    return measured, simulated


def test_leading_matches_counts_the_drafts_the_answer_goes_on_with():
    assert leading_matches([5, 6, 7], [5, 6, 9, 7]) == 2
    assert leading_matches([5, 6, 7], [4, 6, 7]) == 0
    assert leading_matches([5, 6, 7], [5, 6, 7, 8]) == 3
    assert leading_matches([5, 6, 7], [5]) == 1  # the answer ended


def test_replaying_sampled_answers_gives_back_their_steps_and_exact_moments(tiny_pair, sampled):
    """An answer fixes its verify steps: the replay of each answer with the sampler's draft finds
    the sampler's steps, its counts and, step for step, its E and Var (the same drafts and
    target distributions, read from one pass over the answer)."""
    served, runs, paired = sampled
    assert paired.answers == paired.answers_with_vllms_steps == len(served)
    assert paired.replayed.tally.histogram == paired.served.histogram
    expected = [e for run in runs for e in run.expected]
    variance = [v for run in runs for v in run.variance]
    assert paired.replayed.expected == pytest.approx(expected, abs=1e-5)
    assert paired.replayed.variance == pytest.approx(variance, abs=1e-5)
    assert paired.replayed.tally.steps > 250 and sum(variance) > 20  # spread to test with


def test_another_draft_does_not_replay_the_answers(tiny_pair, sampled):
    """The control: replayed with a draft that proposes other tokens (untrained), the answers'
    verify steps are not the ones their counters hold (4 answers: one step per token each)."""
    target, draft, vocab, _, _ = tiny_pair
    served = sampled[0][:4]
    torch.manual_seed(1)
    other = draft.untrained(target.get_input_embeddings().weight.detach()).eval()
    paired = replay_served(target, other, vocab, served, K, TEMPERATURE)
    assert paired.answers_with_vllms_steps == 0
    assert paired.replayed.tally.histogram != paired.served.histogram


def test_the_check_passes_the_matching_figure_and_flags_one_ten_percent_under(sampled):
    """On ~300 verify steps of these answers (standard error ~0.02), the sampler's own length
    agrees with the exact expectation on its answers, and the same figure 10 % lower or higher
    does not (measured on 24 prompts: z -0.05, -6.7 and 6.6). The check it replaces, vLLM's
    interval over prompts overlapping the exact range, passes the 10 % lower one."""
    paired = sampled[2]
    measured, simulated = _rows(paired)
    assert abs(paired_deviation(measured, simulated["trained_on_vllm_answers"])) < 3
    assert vllm_agrees(measured, simulated)
    for factor in (0.9, 1.1):
        shifted = {**measured, "mean_acceptance_length": factor * paired.served.length()}
        z = paired_deviation(shifted, simulated["trained_on_vllm_answers"])
        assert abs(z) > AGREEMENT_Z + 1 and not vllm_agrees(shifted, simulated), (factor, z)
    low = {"mean_acceptance_length": 0.9 * paired.served.length(),
           "interval_95": [0.75 * paired.served.length(), 1.05 * paired.served.length()]}
    assert vllm_agrees(low, {key: value for key, value in simulated.items()
                             if key != "trained_on_vllm_answers"}
                       | {"trained_expected_interval_95": simulated["trained_on_vllm_answers"][
                           "interval_95"]})


def test_a_sampler_that_always_accepts_is_flagged_on_its_own_answers(tiny_pair, monkeypatch):
    """The control with a defect instead of a scaled figure: a sampler that accepts every draft
    token emits answers whose counts lie far above the exact expectation on those answers."""
    monkeypatch.setattr(simulate, "accepts", lambda alpha, generator: True)
    served, _ = _sampled(tiny_pair, prompts=8)
    target, draft, vocab, _, _ = tiny_pair
    paired = replay_served(target, draft, vocab, served, K, TEMPERATURE)
    assert paired.answers_with_vllms_steps == len(served)  # the drafts are the draft's
    measured, simulated = _rows(paired)
    assert paired_deviation(measured, simulated["trained_on_vllm_answers"]) > 2 * AGREEMENT_Z
    assert not vllm_agrees(measured, simulated)
