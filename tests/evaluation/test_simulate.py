"""The sampled simulation's exact expectation (`eagle_ray.evaluation.simulate`): per verify step
E[accepted | context] and Var[accepted | context] from the target's acceptance probabilities of
the drafted tokens, and the sampler, which shares those probabilities, agrees with them."""

import itertools
import math

import pytest
import torch

from eagle_ray.evaluation import simulate
from eagle_ray.evaluation.evaluate import greedy_generate
from eagle_ray.evaluation.simulate import VerifyStep, simulate_acceptance, simulate_sampled

Z = 4.0  # |realised - sum of E[accepted | context]| <= Z * sqrt(sum of Var[accepted | context])
K = 3
MAX_NEW_TOKENS = 32


def _step(alphas: list[float], stopped: bool = False) -> VerifyStep:
    """A step whose draft proposed tokens 0..len-1, accepted with the given probabilities."""
    probs = torch.zeros(K + 1, 8)
    for j, alpha in enumerate(alphas):
        probs[j, j], probs[j, 7] = alpha, 1 - alpha
    probs[len(alphas):, 7] = 1
    return VerifyStep(list(range(len(alphas))), probs, alphas, stopped)


def test_the_moments_are_those_of_the_accepted_counts_distribution():
    """E and Var against the distribution enumerated: P(A = a) = alpha_1..alpha_a (1 -
    alpha_a+1), the whole chain with alpha_1..alpha_k; a chain cut at a stop token is shorter."""
    for alphas in ([0.5, 0.5], [0.9, 0.2, 0.7], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.3]):
        reach = list(itertools.accumulate(alphas, lambda a, b: a * b))
        probability = [1 - alphas[0]] + [
            r * (1 - a) for r, a in zip(reach[:-1], alphas[1:], strict=True)] + [reach[-1]]
        assert sum(probability) == pytest.approx(1)
        mean = sum(a * p for a, p in enumerate(probability))
        variance = sum(a * a * p for a, p in enumerate(probability)) - mean ** 2
        assert _step(alphas).moments() == pytest.approx((mean, variance), abs=1e-12), alphas
    assert _step([0.5, 0.5]).moments() == pytest.approx((0.75, 0.6875))


def test_the_sampler_accepts_with_the_shared_alphas():
    """`_speculate` (the sampler) over 20,000 draws of one step: the mean count accepted within
    4 standard errors of the exact E, the token after an accepted stop token is none, after the
    whole chain the next position's."""
    generator = torch.Generator().manual_seed(0)

    def sample(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=generator))

    step = _step([0.8, 0.5, 0.6])
    counts = [simulate._speculate(step, generator, sample)[0] for _ in range(20_000)]
    mean, variance = step.moments()
    assert abs(sum(counts) / len(counts) - mean) <= 4 * math.sqrt(variance / len(counts))
    assert simulate._speculate(_step([1.0, 1.0], stopped=True), generator, sample) == (2, None)
    assert simulate._speculate(_step([1.0, 1.0, 1.0]), generator, sample) == (3, 7)


def _run(tiny_pair, temperature: float, seed: int = 0) -> simulate.SampledAcceptance:
    target, draft, vocab, prompts, stops = tiny_pair
    return simulate_sampled(target, draft, vocab, prompts, K, temperature, MAX_NEW_TOKENS, stops,
                            seed)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_sampled_count_agrees_with_the_exact_conditional_expectation(tiny_pair, temperature):
    """Realised accepted tokens minus the sum over the verify steps run of E[accepted |
    context] is a martingale: within Z = 4 of sqrt(sum Var[accepted | context]), seeds 0 and 1
    (measured: z 0.16 and 0.85 at t=2 over ~450 steps, sum Var ~65, and a wrong exact formula,
    each position accepted independently, gives z -7.9 and -7.3; at t=1 the tiny target is
    nearly deterministic, sum Var ~0.23, z 0.25, the lengths within 0.001). Per draft position
    the exact share is within 0.05 of the realised one (measured 0.013 at most)."""
    for seed in (0, 1):
        run = _run(tiny_pair, temperature, seed)
        assert abs(run.deviation()) <= Z, (seed, run.length(), run.expected_length())
        assert len(run.expected) == run.tally.steps > 100
        assert run.expected_per_position() == pytest.approx(run.tally.per_position(), abs=0.05)
    if temperature == 2.0:  # the check has power: there is spread to fail it with
        assert sum(run.variance) > 30 and 1.2 < run.expected_length() < 2.5, run.variance


def test_a_sampler_that_always_accepts_fails_the_check(tiny_pair, monkeypatch):
    """The control: the same run with every draft token accepted realises the whole chain at
    every step, far outside the interval (measured: z ~50 at t=2)."""
    monkeypatch.setattr(simulate, "accepts", lambda alpha, generator: True)
    run = _run(tiny_pair, 2.0)
    assert run.length() > 3.5 and run.length() - run.expected_length() > 1
    assert run.deviation() > Z, run.deviation()


def test_a_near_deterministic_target_expects_the_greedy_acceptance(tiny_pair):
    """At t=1e-6 the target's distributions are one-hot (near-zero entropy): the sampled answers
    are the greedy ones, every alpha is 0 or 1, and the exact expectation equals the greedy
    simulation's acceptance length, per position too, with no variance."""
    target, draft, vocab, prompts, stops = tiny_pair
    prompts = prompts[:12]
    run = simulate_sampled(target, draft, vocab, prompts, K, 1e-6, MAX_NEW_TOKENS, stops)
    assert run.answers == [greedy_generate(target, p, MAX_NEW_TOKENS, stops) for p in prompts]
    greedy, per_position = simulate_acceptance(target, draft, vocab, prompts, run.answers, K)
    assert sum(run.variance) < 1e-9
    assert run.expected_length() == pytest.approx(greedy, abs=1e-9) and greedy > 1.5
    assert run.expected_per_position() == pytest.approx(per_position, abs=1e-9)
    assert run.length() == greedy
