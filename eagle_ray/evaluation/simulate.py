"""The project's own acceptance measurement: chain drafting simulated with the target's states (a
backend's: the pool's vLLM engine in an evaluation, the HF model in the tests) and the draft,
independent of vLLM's speculative decoding, greedy and sampled; and what it runs on
(`simulation_target`: the pool's own backend; `load_drafts`: the trained draft and an untrained
baseline).

Per verify step the target has its next token, the draft proposes `k` more from the target's aux
states (greedily, as vLLM's EAGLE proposer does), and the target verifies them. Greedy: a draft
token is accepted while it equals the target's greedy continuation. Sampled (speculative
sampling with a deterministic draft): draft token `x` is accepted with probability `p(x)` under
the target's temperature-scaled distribution; on a rejection the next token is drawn from `p`
without `x`, after `k` acceptances from the next position's `p`. Acceptance length is vLLM's
definition, 1 + accepted / verify steps, so the two measurements compare.

Sampled, the expectation is exact as well (`VerifyStep.moments`): the draft's proposal is a point
mass, so given a step's context draft token j is accepted with `alpha_j = p(d_j | context,
d_<j)` once the ones before it were, and E[accepted | context] and Var[accepted | context]
follow from the alphas without sampling. The realised count minus the sum of these conditional
expectations over the steps the simulation ran is a martingale: it stays within a few
sqrt(sum of the conditional variances) of 0 (`SampledAcceptance.deviation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel
from eagle_ray.config import PoolConfig
from eagle_ray.contract.images import ImageInputs
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.draft.export import load_exported_draft
from eagle_ray.draft.model import Eagle3Draft
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.acceptance import AcceptanceTally


def draft_chain(draft: Eagle3Draft, vocab: DraftVocab, aux_hidden_states: torch.Tensor,
                seq: list[int], next_token: int, k: int,
                positions: torch.Tensor | None = None) -> list[int]:
    """`k` tokens (target ids) the draft proposes after `seq` + `next_token`, greedily, as vLLM
    drafts with it (`Eagle3Draft.propose`: a chain, one forward per token; P-EAGLE: one pass);
    `positions` `[1, len(seq)]` where the target's are not 0 .. (an image prompt's)."""
    if positions is None:
        proposed = draft.propose(aux_hidden_states, seq, next_token, k, vocab.draft_to_target)
    else:
        proposed = draft.propose(aux_hidden_states, seq, next_token, k, vocab.draft_to_target,
                                 positions=positions)
    return [int(vocab.draft_to_target[i]) for i in proposed]


def target_states(target: RunnerEagle3TargetModel, ids: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux states `[1, S, N*H]` (ascending layers) and final pre-norm states
    `[1, S, H]` at every position of `ids`, on the target's device, from either layout a runner
    returns: padded tensors (HF), or a captured row (vLLM: `[S, N + 1, H]`, copied out of the
    hand-off, whose ring the next call reuses)."""
    aux, last_hidden, _ = row_states(target, ids)
    return aux, last_hidden


def row_states(target: RunnerEagle3TargetModel, ids: list[int],
               images: ImageInputs | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`target_states` of one row with its `images` (a vision-language target's), and the
    positions the draft sits at there (`[1, S]`; None: 0 .. S-1)."""
    tensor = torch.tensor([ids])
    ones = torch.ones_like(tensor)
    out = (target.runner.run(tensor, ones) if images is None
           else target.runner.run(tensor, ones, images=images))
    if out.rows is None:
        return out.aux_hidden_states, out.last_hidden, out.positions
    row = out.rows[0].to(target.device, copy=True)
    return row[None, :, :-1].flatten(2), row[None, :, -1], out.positions


@torch.inference_mode()
def draft_seconds_per_verify_step(target: RunnerEagle3TargetModel, draft: Eagle3Draft,
                                  vocab: DraftVocab, prompts: list[list[int]],
                                  ks: list[int] | tuple[int, ...], repeats: int = 3
                                  ) -> dict[int, float]:
    """Per k, the median wall time of the draft's proposal for one verify step after each
    prompt, on the draft's device: what vLLM runs per step (k forwards for a chain, one for
    parallel drafting) without the engine around it (the target runs once per prompt). Nothing
    asserts it: a measurement, not a rule."""
    seconds: dict[int, list[float]] = {k: [] for k in ks}
    for prompt in prompts:
        aux, _ = target_states(target, prompt)
        for k, _ in itertools.product(ks, range(repeats)):
            _synchronize(aux.device)
            start = time.perf_counter()
            draft_chain(draft, vocab, aux, prompt, prompt[-1], k)
            _synchronize(aux.device)
            seconds[k].append(time.perf_counter() - start)
    return {k: statistics.median(s) if s else math.nan for k, s in seconds.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def simulate_acceptance(target: RunnerEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                        prompts: list[list[int]], continuations: list[list[int]], k: int,
                        images: Sequence[ImageInputs | None] | None = None
                        ) -> tuple[float, list[float]]:
    """Greedy: mean acceptance length over each prompt's greedy continuation (up to its
    end-of-turn token, as vLLM stops there), and the share accepted per draft position;
    `images`: each prompt's, for a vision-language target."""
    head = target.get_target_head()
    tally = AcceptanceTally.empty(k)
    for prompt, continuation, image in zip(prompts, continuations,
                                           images or [None] * len(prompts), strict=True):
        seq, produced = list(prompt), 0
        while produced < len(continuation):
            aux, last_hidden, positions = row_states(target, seq, image)
            next_token = int(head(last_hidden[0, -1]).argmax())
            truth = continuation[produced + 1: produced + 1 + k]
            if not truth:  # the answer ends with this token: no draft left to verify
                break
            drafted = draft_chain(draft, vocab, aux, seq, next_token, k, positions)
            accepted = 0
            while accepted < len(truth) and drafted[accepted] == truth[accepted]:
                accepted += 1
            seq += [next_token] + drafted[:accepted]
            produced += 1 + accepted
            tally.record(accepted)
    return tally.length(), tally.per_position()


@torch.inference_mode()
def target_top_probability(target: RunnerEagle3TargetModel, prompts: list[list[int]],
                           continuations: list[list[int]]) -> float:
    """The target's mean probability of its most likely next token (temperature 1) along its
    own greedy answers: how sure it is. Near 1, sampling at temperature 1 picks what greedy
    does and sampled acceptance cannot differ from greedy; NaN with no answer."""
    head = target.get_target_head()
    total, count = 0.0, 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        if not continuation:
            continue
        _, last_hidden = target_states(target, prompt + continuation[:-1])
        hidden = last_hidden[0, len(prompt) - 1:]
        total += float(torch.softmax(head(hidden).float(), dim=-1).amax(dim=-1).sum())
        count += len(continuation)
    return total / count if count else float("nan")


@dataclasses.dataclass
class VerifyStep:
    """One verify step of speculative sampling with a greedy (deterministic) draft: the drafted
    tokens up to and including the first stop token (an accepted stop token ends the answer, so
    the chain ends there: `stopped`), the target's distributions on the host, `probs[j]` for
    the token after `next_token` + `drafted[:j]` (j = 0..k), and `alphas[j] = probs[j,
    drafted[j]]`: draft token j's acceptance probability once the ones before it were accepted
    (min(1, p / q) with q a point mass on it). The sampler and the exact moments share them."""

    drafted: list[int]
    probs: torch.Tensor
    alphas: list[float]
    stopped: bool

    def reach(self) -> list[float]:
        """Per draft position j, P(accepted | context) = alpha_1 * ... * alpha_j."""
        reach, product = [], 1.0
        for alpha in self.alphas:
            product *= alpha
            reach.append(product)
        return reach

    def moments(self) -> tuple[float, float]:
        """E[A | context] and Var[A | context] of A, the draft tokens this step accepts:
        A = sum_j 1[positions 1..j accepted], so E[A] = sum_j P_j and, as 1[j] * 1[l] =
        1[max(j, l)], E[A^2] = sum_j (2j - 1) P_j, with P_j = `reach()[j - 1]`."""
        reach = self.reach()
        mean = sum(reach)
        square = sum((2 * j + 1) * p for j, p in enumerate(reach))
        return mean, max(square - mean * mean, 0.0)


@dataclasses.dataclass
class SampledAcceptance:
    """A sampled simulation: the accepted counts it realised (`tally`), per verify step it ran
    E[accepted | that step's context] and Var[accepted | that step's context] (exact, from the
    alphas), per draft position the sum over steps of P(accepted | context), and the answers.

    The exact figure is conditional on the contexts the simulation sampled, not on reference
    (greedy) answers: at temperature t the target's own answers are what vLLM verifies too,
    while a greedy answer is a more predictable context than a sampled one and would overstate
    acceptance. It is the realised figure with the acceptance coin flips averaged out (what
    remains random is which answers were sampled), the same expectation with less noise."""

    tally: AcceptanceTally
    expected: list[float] = dataclasses.field(default_factory=list)
    variance: list[float] = dataclasses.field(default_factory=list)
    reach: list[float] = dataclasses.field(default_factory=list)
    answers: list[list[int]] = dataclasses.field(default_factory=list)

    def record(self, step: VerifyStep, accepted: int) -> None:
        self.tally.record(accepted)
        mean, variance = step.moments()
        self.expected.append(mean)
        self.variance.append(variance)
        for j, p in enumerate(step.reach()):
            self.reach[j] += p

    def length(self) -> float:
        """Realised: 1 + accepted / verify steps."""
        return self.tally.length()

    def expected_length(self) -> float:
        """Exact: 1 + sum of E[accepted | context] / verify steps; NaN before any step."""
        steps = self.tally.steps
        return 1 + sum(self.expected) / steps if steps else float("nan")

    def expected_per_position(self) -> list[float]:
        steps = self.tally.steps
        return [p / steps if steps else float("nan") for p in self.reach]

    def expected_interval(self, z: float = 1.96) -> tuple[float, float]:
        """Where the realised length falls with probability ~95 % given the sampled contexts:
        the exact length +- z sqrt(sum of Var[accepted | context]) / verify steps."""
        steps = self.tally.steps
        if not steps:
            return float("nan"), float("nan")
        half = z * math.sqrt(sum(self.variance)) / steps
        return self.expected_length() - half, self.expected_length() + half

    def deviation(self) -> float:
        """(realised accepted - sum of E[accepted | context]) / sqrt(sum of Var[accepted |
        context]): a martingale's sum over its conditional spread, about N(0, 1) over many
        steps; 0 when both agree with no spread, infinite when they differ with none."""
        gap, spread = self.tally.accepted - sum(self.expected), math.sqrt(sum(self.variance))
        if spread > 0:
            return gap / spread
        return 0.0 if abs(gap) < 1e-9 else math.copysign(math.inf, gap)


def accepts(alpha: float, generator: torch.Generator) -> bool:
    """Speculative sampling's test for a draft token the draft proposed with certainty."""
    return float(torch.rand((), generator=generator)) < alpha


def _speculate(step: VerifyStep, generator: torch.Generator, sample) -> tuple[int, int | None]:
    """(draft tokens accepted, the token after them): on a rejection drawn from `p` without the
    rejected token, after the whole chain from the next position's `p`, None when an accepted
    stop token ended the answer."""
    for j, (token, alpha) in enumerate(zip(step.drafted, step.alphas, strict=True)):
        if not accepts(alpha, generator):
            rest = step.probs[j].clone()
            rest[token] = 0
            return j, sample(rest / rest.sum())
    accepted = len(step.drafted)
    return accepted, None if step.stopped else sample(step.probs[accepted])


def _verify(target: RunnerEagle3TargetModel, distribution, draft: Eagle3Draft, vocab: DraftVocab,
            aux: torch.Tensor, seq: list[int], next_token: int, k: int, stops: set[int]
            ) -> tuple[VerifyStep, torch.Tensor]:
    """The draft's chain after `seq` + `next_token` and the target's verdict on it; with the
    target's aux states of the verified sequence (those of `seq` are a causal prefix)."""
    drafted = draft_chain(draft, vocab, aux, seq, next_token, k)
    verified_aux, last_hidden = target_states(target, seq + [next_token] + drafted)
    probs = distribution(last_hidden[0, len(seq):])
    end = next((j + 1 for j, token in enumerate(drafted) if token in stops), None)
    alphas = [float(probs[j, token]) for j, token in enumerate(drafted[:end])]
    return VerifyStep(drafted[:end], probs, alphas, end is not None), verified_aux


@torch.inference_mode()
def simulate_sampled(target: RunnerEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                     prompts: list[list[int]], k: int, temperature: float, max_new_tokens: int,
                     stop_token_ids: tuple[int, ...], seed: int = 0) -> SampledAcceptance:
    """Sampled at `temperature` (> 0): speculative sampling of the target's own answers, each
    up to `max_new_tokens` or a stop token (see the module doc), with the exact conditional
    moments of every verify step it ran."""
    head = target.get_target_head()
    generator = torch.Generator().manual_seed(seed)
    stops = set(stop_token_ids)
    result = SampledAcceptance(AcceptanceTally.empty(k), reach=[0.0] * k)

    def distribution(hidden: torch.Tensor) -> torch.Tensor:  # on the host: sampled there
        return torch.softmax(head(hidden).float() / temperature, dim=-1).cpu()

    def sample(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=generator))

    for prompt in prompts:
        # aux: the states of every token of seq (causal: a longer run's prefix)
        aux, last_hidden = target_states(target, prompt)
        seq, next_token = list(prompt), sample(distribution(last_hidden[0, -1]))
        while next_token not in stops and len(seq) - len(prompt) + 1 < max_new_tokens:
            step, aux = _verify(target, distribution, draft, vocab, aux, seq, next_token, k,
                                stops)
            accepted, following = _speculate(step, generator, sample)
            result.record(step, accepted)
            seq += [next_token] + step.drafted[:accepted]
            aux = aux[:, :len(seq)]
            if following is None:  # an accepted stop token: the answer ends with it
                break
            next_token = following
        else:  # the last token drawn (a stop token, or the answer's last) ends the answer
            seq.append(next_token)
        result.answers.append(seq[len(prompt):])
    return result


def simulate_sampled_acceptance(target: RunnerEagle3TargetModel, draft: Eagle3Draft,
                                vocab: DraftVocab, prompts: list[list[int]], k: int,
                                temperature: float, max_new_tokens: int,
                                stop_token_ids: tuple[int, ...], seed: int = 0
                                ) -> tuple[float, list[float]]:
    """`simulate_sampled`'s realised acceptance length and share accepted per draft position."""
    run = simulate_sampled(target, draft, vocab, prompts, k, temperature, max_new_tokens,
                           stop_token_ids, seed)
    return run.length(), run.tally.per_position()


@contextlib.contextmanager
def simulation_target(pool: PoolConfig, serving: DraftServing, longest: int
                      ) -> Iterator[RunnerEagle3TargetModel]:
    """The pool's own backend (a replica's: vLLM at the pool's `tp_size` by default) on the
    served checkpoint and dtype, capturing the draft's aux layers, its engine sized for
    sequences of `longest` tokens and run in processes of its own (the serving engines after it
    size themselves from the memory it leaves): the simulation needs the target's aux states and
    distributions at every position, which is what a replica computes. Shut down on exit."""
    from eagle_ray.backends import build_backend
    from eagle_ray.backends.engines import ENGINES
    from eagle_ray.draft.export import exported_target

    config = dataclasses.replace(
        pool, model_path=serving.model_path, dtype=serving.dtype,
        aux_layer_ids=list(exported_target(serving.draft_dir).aux_layer_ids),
        vllm_kwargs={k: v for k, v in pool.vllm_kwargs.items() if k != "max_model_len"})
    engine = ENGINES.get(config.backend)
    if engine is not None:  # in its own process: its memory is back before serving starts
        config = engine.in_own_process(engine.sized_for(config, longest))
    target = build_backend(config)
    try:
        yield target
    finally:
        target.shutdown()


def load_drafts(target: RunnerEagle3TargetModel, draft_dir: str
            ) -> tuple[Eagle3Draft, Eagle3Draft, DraftVocab]:
    """The exported draft and an untrained one of its shape (seeded), in fp32 as trained, on
    the target's device (its head's), and the draft vocabulary."""
    embedding = target.get_input_embeddings().weight.detach().float()
    trained, vocab = load_exported_draft(draft_dir, embedding)
    torch.manual_seed(1234)
    untrained = trained.untrained(embedding)
    return trained.to(target.device).eval(), untrained.to(target.device).eval(), vocab
